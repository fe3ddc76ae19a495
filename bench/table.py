"""The side-by-side table of bench/gpu_check.sh: bench/step.py's and bench/torch_gpt2.py's last lines, read
from their logs, as ms/step, tok/s, the ratio to torch.compile's tok/s, nvidia-smi's peak memory and the
median SM clock and power it saw while the steps ran (bench/gpu_sampler.py).

    python -m bench.table LABEL=LOG ... --yardstick LABEL [--limit TOK_S]

--limit is what the GPU could do at most (its practical FLOP/s over the model's FLOPs per token); each row
then also says what fraction of it the step reaches. A run whose log has no steps in a row is left out, with
one line on stderr that says why; the yardstick's must have them.
"""
import re
import sys

from bench.gpu_sampler import CLOCK
from llm.launch import Parser, UserError, run

STEPS = re.compile(r"steps in a row: ([\d.]+) ms/step \| (\d+) tok/s")
PEAK = re.compile(r"nvidia-smi (\d+) MiB")


def read(path):
    """From a benchmark's log, ((ms, tok/s, peak MiB or None, "clock, power" or None), None), or (None, its
    last line) where it has no steps in a row (the run did not finish)."""
    try:
        text = open(path).read()
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}") from None
    steps, peaks, clocks = STEPS.findall(text), PEAK.findall(text), CLOCK.findall(text)
    if not steps:
        return None, ([line for line in text.splitlines() if line.strip()] or ["(empty)"])[-1]
    ms, tok_s = steps[-1]
    clock = f"{int(clocks[-1][0]):,} MHz, {clocks[-1][1]}" if clocks else None
    return (float(ms), int(tok_s), int(peaks[-1]) if peaks else None, clock), None


def main(argv):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="LABEL=LOG")
    parser.add_argument("--yardstick", required=True, help="the label the ratios are taken against")
    parser.add_argument("--limit", type=float, help="tok/s at the GPU's practical limit")
    args = parser.parse_args(argv)
    runs = dict(item.rpartition("=")[::2] for item in args.runs)   # label -> log
    if args.yardstick not in runs:
        raise UserError(f"--yardstick {args.yardstick}: not one of the labels ({', '.join(runs)})")
    rows = {}
    for label, path in runs.items():
        row, last = read(path)
        unfinished = f"{path}: no 'N steps in a row: ... ms/step | ... tok/s' line: did the run finish?"
        if row is None and label == args.yardstick:
            raise UserError(unfinished)
        if row is None:   # a run that did not finish (cuDNN's frontend missing, say) is left out
            print(f"left out '{label}': {unfinished} Its last line: {last}", file=sys.stderr)
        else:
            rows[label] = row
    base = rows[args.yardstick][1]
    print("| system | ms/step | tok/s | vs torch.compile | peak MiB (nvidia-smi) | SM clock, power (median) |"
          + (" of the GPU's limit |" if args.limit else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.limit else ""))
    for label, (ms, tok_s, peak, clock) in rows.items():
        limit = f" {tok_s / args.limit:.0%} |" if args.limit else ""
        peak = f"{peak:,}" if peak is not None else "n/a"
        print(f"| {label} | {ms:.1f} | {tok_s / 1000:.0f}K | {tok_s / base:.2f}x | {peak} | "
              f"{clock or 'n/a'} |{limit}")


if __name__ == "__main__":
    run(main)
