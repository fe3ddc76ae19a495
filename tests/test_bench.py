"""bench/table.py reads bench/step.py's and bench/torch_gpt2.py's logs into the side-by-side table: the
figure it takes is the time of the steps in a row, and a log without one is one line, not a wrong row.
The benchmarks' counts and lengths are checked before anything runs."""
import subprocess
import sys

import pytest

from conftest import REPO, env


def python(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=300)


def test_the_table_takes_the_steps_in_a_row_of_each_log_and_the_ratio_to_the_yardstick(tmp_path):
    ours = python(["-m", "bench.step", "--backend", "numpy", "--model", "d2c64h4", "-b", "2", "-t", "32",
                   "--steps", "3"], cwd=REPO)
    assert ours.returncode == 0, ours.stderr
    line = next(x for x in ours.stdout.splitlines() if "steps in a row" in x)
    ms = float(line.split("in a row: ")[1].split(" ms")[0])
    tok_s = int(line.split("| ")[1].split(" tok/s")[0])
    assert abs(2 * 32 / ms * 1000 - tok_s) <= 0.01 * tok_s   # ms is printed to 0.1
    (tmp_path / "ours.log").write_text(ours.stdout)
    (tmp_path / "torch.log").write_text(   # bench/torch_gpt2.py's last line, at half our speed
        f"torch 2.11 torch.compile sdpa=default loss=padded d2c64h4 B=2 T=32 bf16: loss 10.8 | "
        f"20 steps in a row: {2 * ms:.1f} ms/step | {tok_s // 2} tok/s | peak memory: nvidia-smi 1234 MiB, "
        f"torch reserved 1000 MiB\n")
    table = python(["-m", "bench.table", f"ours={tmp_path / 'ours.log'}", f"torch={tmp_path / 'torch.log'}",
                    "--yardstick", "torch"], cwd=REPO)
    assert table.returncode == 0, table.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.stdout.splitlines()[2:]}
    assert f"| {ms:.1f} | " in rows["ours"] and " n/a |" in rows["ours"]         # no nvidia-smi on the CPU
    assert f"| {tok_s / (tok_s // 2):.2f}x |" in rows["ours"] and "| 1.00x | 1,234 |" in rows["torch"]


def test_a_log_without_steps_in_a_row_is_one_line(tmp_path):
    (tmp_path / "cut.log").write_text("warm-up step 1: loss 10.8\n")
    proc = python(["-m", "bench.table", f"ours={tmp_path / 'cut.log'}", "--yardstick", "ours"], cwd=REPO)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "cut.log: no 'N steps in a row: ... ms/step | ... tok/s' line: did the run finish?" in proc.stderr


@pytest.mark.parametrize("args, message", [
    # once a ZeroDivisionError
    (["bench.step", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench.step", "-b", "-2"], "argument -b: must be at least 1, got -2"),
    (["bench.step", "--model", "d2c64h4", "-t", "2000"], "-t 2000 is longer than d2c64h4's 1024 positions"),
    (["bench.step", "-r", "3"], "argument -r: invalid choice: 3"),
    # once min() of nothing
    (["bench.checksum", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["bench.kernels", "--steps", "x"], ""),   # torch first: without it, its one line
])
def test_a_count_or_length_a_benchmark_cannot_use_is_one_line(args, message):
    proc = python(["-m", *args], cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr
