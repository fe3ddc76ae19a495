"""Plot a run's loss curves: python -m llm.plot DIR [-o loss.png] [--log]

Reads DIR/main.log, the log train_gpt2.py writes with -o DIR in llm.c's format:
    s:%d trl:%f    train loss at a step (more fields may follow)
    s:%d tel:%f    val loss
    s:%d eval:%f   HellaSwag accuracy, when the run evaluated it (-h 1)
and draws train and val loss against step, with HellaSwag accuracy on a second axis when there is any.

Plotting needs matplotlib, an optional extra (pip install -e ".[plot]"). It is imported only when a figure is
drawn, so nothing else in llm/ depends on it, and it draws with Agg, which needs no display.
"""
import logging
import os
import re

from .launch import Parser, UserError, optional, output_file, run

LINE = re.compile(r"s:(\d+) (trl|tel|eval):(\S+)")


def read_log(path):
    """-> train, val, evals: lists of (step, value) from a main.log, in the order of the file. Lines that are
    not log lines (a damaged or foreign file) are passed over."""
    series = {"trl": [], "tel": [], "eval": []}
    with open(path, errors="replace") as f:
        for line in f:
            if m := LINE.match(line):
                try:
                    series[m.group(2)].append((int(m.group(1)), float(m.group(3))))
                except ValueError:
                    pass
    return series["trl"], series["tel"], series["eval"]


def figure(train, val, evals, title, log_scale=False):
    """A matplotlib Figure of 800 x 500 pixels: loss against step, and HellaSwag accuracy on the right."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter
    fig = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)                                   # Agg renders to memory: no window, no display
    ax = fig.add_subplot()
    train_marker = "o" if len(train) == 1 else None       # a line through one point draws nothing
    for points, label, color, marker in ((train, "train loss", "tab:blue", train_marker),
                                         (val, "val loss", "tab:red", "o")):
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, color=color, label=label, marker=marker, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if log_scale:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))    # 4 rather than 4 x 10^0
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    handles, labels = ax.get_legend_handles_labels()
    if evals:
        acc = ax.twinx()
        steps, values = zip(*evals)
        acc.plot(steps, values, color="tab:green", label="HellaSwag accuracy", marker="s", markersize=3)
        acc.set_ylabel("HellaSwag accuracy")
        more_handles, more_labels = acc.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 1), ncol=3, frameon=False)   # above
    return fig


def main(argv):
    parser = Parser(description="Plot train and val loss (and HellaSwag accuracy) from DIR/main.log.")
    parser.add_argument("dir", help="a run's output directory, as given to train_gpt2.py -o")
    parser.add_argument("-o", "--out", help="image to write (default DIR/loss.png)")
    parser.add_argument("--log", action="store_true", help="log-scale loss axis")
    args = parser.parse_args(argv)
    log = os.path.join(args.dir, "main.log")
    if not os.path.exists(log):
        raise UserError(f"{log}: no such file (train with -o {args.dir} first)")
    out = output_file(args.out or os.path.join(args.dir, "loss.png"), "-o")
    if not os.path.splitext(out)[1]:
        out += ".png"   # what matplotlib would add: the line below then names the file it wrote
    try:
        train, val, evals = read_log(log)
    except OSError as e:
        raise UserError(f"{log}: cannot read ({e.strerror})") from None
    if not train and not val:
        raise UserError(f"{log}: no s:N trl:/tel: lines to plot")
    title = f"{os.path.basename(os.path.abspath(args.dir))}: loss against step"
    # matplotlib warns, in lines of its own, when it cannot write its cache under $HOME; it draws the same
    logging.getLogger("matplotlib").setLevel(logging.ERROR)
    optional("matplotlib", "plot")   # before the figure: without it, one line
    fig = figure(train, val, evals, title, log_scale=args.log)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:
        fig.savefig(out)
    except ValueError as e:   # an image format matplotlib does not write: it names the ones it does
        raise UserError(f"-o {out}: {e}") from None
    print(f"wrote {out}: {len(train)} train and {len(val)} val points"
          + (f", {len(evals)} HellaSwag points" if evals else ""))
    return 0


if __name__ == "__main__":
    run(main)
