"""The side-by-side table of bench/gpu_check.sh: bench/step.py's and bench/torch_gpt2.py's last lines, read
from their logs, as ms/step, tok/s, the ratio to torch.compile's tok/s, nvidia-smi's peak memory and the
median SM clock and power it saw while the steps ran (bench/gpu_sampler.py).

    python -m bench.table LABEL=LOG ... --yardstick LABEL [--limit TOK_S]

--limit is what the GPU could do at most (its practical FLOP/s over the model's FLOPs per token); each row
then also says what fraction of it the step reaches. A run whose log has no steps in a row is left out, with
one line on stderr that says why; the yardstick's must have them.
"""
import argparse
import re
import sys

from bench import positive_number
from bench.gpu_sampler import CLOCK
from llm.launch import Parser, UserError, run

STEPS = re.compile(r"steps in a row: ([\d.]+) ms/step \| (\d+) tok/s")
PEAK = re.compile(r"nvidia-smi (\d+) MiB")
A_LOG = "name a log that bench.step or bench.torch_gpt2 wrote"


def labelled(item):
    """An argparse type: LABEL=LOG as (label, log); the label may hold '=', the log's path may not."""
    label, _, path = item.rpartition("=")
    if not label or not path:
        raise argparse.ArgumentTypeError(f"needs LABEL=LOG, got '{item}'")
    return label, path


def read(path):
    """From a benchmark's log, ((ms, tok/s, peak MiB or None, "clock, power" or None), None), or (None, its
    last line) where it has no steps in a row (the run did not finish)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}): {A_LOG}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a text log (its byte {e.start} is not UTF-8): {A_LOG}") from None
    steps, peaks, clocks = STEPS.findall(text), PEAK.findall(text), CLOCK.findall(text)
    if not steps:
        return None, ([line for line in text.splitlines() if line.strip()] or ["(empty)"])[-1]
    ms, tok_s = steps[-1]
    try:
        ms = float(ms)
    except ValueError:   # a line garbled in the middle ("1.2.3 ms/step")
        raise UserError(f"{path}: '{ms} ms/step' in its steps in a row is not a number: {A_LOG}") from None
    clock = f"{int(clocks[-1][0]):,} MHz, {clocks[-1][1]}" if clocks else None
    return (ms, int(tok_s), int(peaks[-1]) if peaks else None, clock), None


def main(argv):
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=labelled, help="LABEL=LOG")
    parser.add_argument("--yardstick", required=True, help="the label the ratios are taken against")
    parser.add_argument("--limit", type=positive_number, help="tok/s at the GPU's practical limit")
    args = parser.parse_args(argv)
    runs = {}   # label -> log
    for label, path in args.runs:
        if label in runs:   # one row would replace the other
            parser.error(f"the label '{label}' is given twice: give each run its own")
        runs[label] = path
    if args.yardstick not in runs:
        raise UserError(f"--yardstick {args.yardstick}: not one of the labels ({', '.join(runs)})")
    logs = {label: read(path) for label, path in runs.items()}   # every log checked before a line is printed
    unfinished = "no 'N steps in a row: ... ms/step | ... tok/s' line: did the run finish?"
    row, _ = logs[args.yardstick]
    if row is None:
        raise UserError(f"{runs[args.yardstick]}: {unfinished}")
    base = row[1]   # the yardstick's tok/s
    if base == 0:
        raise UserError(f"--yardstick {args.yardstick}: {runs[args.yardstick]} reads 0 tok/s, and there is "
                        "no ratio to 0: choose another yardstick")
    rows = {}
    for label, (row, last) in logs.items():
        if row is None:   # a run that did not finish (cuDNN's frontend missing, say) is left out
            print(f"left out '{label}': {runs[label]}: {unfinished} Its last line: {last}", file=sys.stderr)
        else:
            rows[label] = row
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
