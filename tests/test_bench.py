"""bench/table.py reads bench/step.py's and bench/torch_gpt2.py's logs into the side-by-side table: the
figure it takes is the time of the steps in a row, and a log without one is one line, not a wrong row;
nvidia-smi's lines give the peak memory and the median clock and power. The per-op table counts each
op's time once.
The benchmarks' counts and lengths, the table's logs and figures, the checksum's folder and gpu_check.sh's
stages are checked before anything runs. bench/kernels.py's report adds up the GPU's idle gaps and sets
the host's calls beside the longest. bench/gemms.py names the plan of each GEMM an op issues (on a stand-in
for BlasLt)."""
import os
import re
import subprocess
import sys

import pytest

from bench.gemms import recording
from bench.gpu_sampler import CLOCK, GpuSampler, summary
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
    (tmp_path / "torch.log").write_text(   # bench/torch_gpt2.py's last two lines, at half our speed
        "nvidia-smi while the steps ran: SM clock median 1650 MHz (lowest 1305), power median 690 W\n"
        f"torch 2.11 torch.compile sdpa=default loss=padded d2c64h4 B=2 T=32 bf16: loss 10.8 | "
        f"20 steps in a row: {2 * ms:.1f} ms/step | {tok_s // 2} tok/s | peak memory: nvidia-smi 1234 MiB, "
        f"torch reserved 1000 MiB\n")
    table = python(["-m", "bench.table", f"ours={tmp_path / 'ours.log'}", f"torch={tmp_path / 'torch.log'}",
                    "--yardstick", "torch"], cwd=REPO)
    assert table.returncode == 0, table.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.stdout.splitlines()[2:]}
    assert f"| {ms:.1f} | " in rows["ours"] and rows["ours"].endswith(" | n/a | n/a |")   # no nvidia-smi here
    assert f"| {tok_s / (tok_s // 2):.2f}x |" in rows["ours"]
    assert rows["torch"].endswith("| 1.00x | 1,234 | 1,650 MHz, 690 W |")


def test_the_per_op_table_counts_an_op_inside_another_once():
    """NumPy's matmul_gelu_forward and _backward call matmul_forward, matmul_backward and gelu_forward: the
    table counts the 3 direct matmuls a layer and lm_head's, and no GELU of its own."""
    out = python(["-m", "bench.step", "--backend", "numpy", "--model", "d2c64h4", "-b", "2", "-t", "32",
                  "--steps", "1"], cwd=REPO)
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("per-op time of one step (")[1].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:]}
    assert rows["matmul_forward"][0] == rows["matmul_backward"][0] == str(3 * 2 + 1)
    assert rows["matmul_gelu_forward"][0] == rows["matmul_gelu_backward"][0] == "2"
    assert "gelu_forward" not in rows
    in_ops = float(table[0].split(" ms")[0])
    assert abs(sum(float(ms) for _, ms, _ in rows.values()) - in_ops) < 0.01 * len(rows)   # printed to 0.01


def test_the_sampler_takes_the_peak_memory_and_the_median_clock_and_power_of_nvidia_smis_lines():
    lines = ["23000, 1980, 120.5", "23109, 1650, 690.2", "23109, 1305, 701.5", "", "23050, 1700, [N/A]"]
    assert summary(lines) == (23109, 1675, 1305, 690)
    assert summary(["1234, 1980, [N/A]"]) == (1234, 1980, 1980, None)
    assert summary([]) == (None, None, None, None)
    smi = GpuSampler("0")
    smi.peak_mib, smi.clock_mhz, smi.lowest_clock_mhz, smi.power_w = summary(lines)
    assert CLOCK.search(smi.clock_line()).groups() == ("1675", "690 W")   # what bench.table reads


def test_the_sampler_without_nvidia_smi_reads_nothing_and_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))   # a directory without nvidia-smi
    with GpuSampler("0") as smi:
        pass
    assert (smi.peak_mib, smi.clock_mhz, smi.power_w) == (None, None, None)
    assert smi.clock_line() == "nvidia-smi while the steps ran: SM clock n/a"


def test_a_log_without_steps_in_a_row_is_one_line(tmp_path):
    (tmp_path / "cut.log").write_text("warm-up step 1: loss 10.8\n")
    proc = python(["-m", "bench.table", f"ours={tmp_path / 'cut.log'}", "--yardstick", "ours"], cwd=REPO)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert "cut.log: no 'N steps in a row: ... ms/step | ... tok/s' line: did the run finish?" in proc.stderr
    # another run's unfinished log leaves its row out, with its last line (why it stopped), and no wrong row
    (tmp_path / "torch.log").write_text("torch: loss 10.8 | 20 steps in a row: 100.0 ms/step | 2000 tok/s\n")
    (tmp_path / "cudnn.log").write_text("\nerror: --attention cudnn needs cuDNN's Python frontend\n\n")
    proc = python(["-m", "bench.table", f"cudnn={tmp_path / 'cudnn.log'}", f"torch={tmp_path / 'torch.log'}",
                   "--yardstick", "torch"], cwd=REPO)
    assert proc.returncode == 0 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("left out 'cudnn': ") and proc.stderr.endswith(
        "Its last line: error: --attention cudnn needs cuDNN's Python frontend\n")
    assert [line.split(" | ")[0] for line in proc.stdout.splitlines()[2:]] == ["| torch"]


A_LOG = "name a log that bench.step or bench.torch_gpt2 wrote"
USAGE = " (--help lists the flags)"


@pytest.mark.parametrize("args, message", [
    # once a ZeroDivisionError, after the line that left 'cut' out
    (["cut=cut.log", "zero=zero.log", "--yardstick", "zero"],
     "--yardstick zero: zero.log reads 0 tok/s, and there is no ratio to 0: choose another yardstick"),
    # once a UnicodeDecodeError
    (["a=binary.log", "--yardstick", "a"], f"binary.log: not a text log (its byte 1 is not UTF-8): {A_LOG}"),
    (["a=.", "--yardstick", "a"], f".: cannot read it (Is a directory): {A_LOG}"),
    (["a=garbled.log", "--yardstick", "a"],   # once a ValueError
     f"garbled.log: '1.2.3 ms/step' in its steps in a row is not a number: {A_LOG}"),
    # once -20000% and nan%
    (["a=ok.log", "--yardstick", "a", "--limit", "-5"],
     f"argument --limit: needs a finite number above 0, got '-5'{USAGE}"),
    (["a=ok.log", "--yardstick", "a", "--limit", "nan"],
     f"argument --limit: needs a finite number above 0, got 'nan'{USAGE}"),
    (["a=ok.log", "--yardstick", "a", "--limit", "0"],   # once no column at all
     f"argument --limit: needs a finite number above 0, got '0'{USAGE}"),
    (["ok.log", "--yardstick", "a"], f"argument runs: needs LABEL=LOG, got 'ok.log'{USAGE}"),
    # once the second row replaced the first
    (["a=ok.log", "a=zero.log", "--yardstick", "a"],
     f"the label 'a' is given twice: give each run its own{USAGE}"),
])
def test_every_log_and_figure_the_table_reads_is_checked_and_a_bad_one_is_one_line(args, message, tmp_path):
    (tmp_path / "ok.log").write_text("6 steps in a row: 100.0 ms/step | 640 tok/s\n")
    (tmp_path / "zero.log").write_text("6 steps in a row: 9000.0 ms/step | 0 tok/s\n")
    (tmp_path / "garbled.log").write_text("6 steps in a row: 1.2.3 ms/step | 640 tok/s\n")
    (tmp_path / "cut.log").write_text("warm-up step 1: loss 10.8\n")
    (tmp_path / "binary.log").write_bytes(b"\x00\x88\x13steps in a row")
    proc = python(["-m", "bench.table", *args], cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"error: {message}\n")


def test_a_checksum_folder_that_cannot_be_written_is_one_line_naming_dir_before_any_work(tmp_path):
    """Once the line came after the parameters were made, and named the temporary folder made inside."""
    (tmp_path / "file").write_text("")
    place = tmp_path / "file" / "checksums"
    proc = python(["-m", "bench.checksum", "--model", "d2c64h4", "--dir", str(place)], cwd=REPO)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        1, "", f"error: --dir {place}: a part of the path is a file, not a folder: choose another place\n")


GPU_CHECK = os.path.join(REPO, "bench", "gpu_check.sh")
STAGES = re.search(r'^STAGES="(.+)"$', open(GPU_CHECK).read(), re.M).group(1)


@pytest.mark.parametrize("stages, variables, message", [
    (["env", "nosuch"], {}, f"unknown stage 'nosuch': choose from {STAGES}"),   # once ran env, then exit 0
    (["env", "ab"], {"BASELINE": "."},
     "stage ab needs BASELINE=DIR, a tree of the project (git archive COMMIT | tar -x -C DIR)"),
    (["env"], {"OUT": "file/logs"}, "OUT=file/logs: cannot write there: choose another folder"),
])
def test_gpu_check_checks_every_stage_and_what_it_needs_before_running_any(stages, variables, message,
                                                                          tmp_path):
    (tmp_path / "file").write_text("")
    proc = subprocess.run(["bash", GPU_CHECK, *stages], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={**env(), "OUT": "logs", **variables})
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"error: {message}\n")
    assert sorted(os.listdir(tmp_path)) == ["file"]   # no log folder made


@pytest.mark.parametrize("args, message", [
    # once a ZeroDivisionError
    (["bench.step", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["bench.step", "-b", "-2"], "argument -b: must be at least 1, got -2"),
    (["bench.step", "--model", "d2c64h4", "-t", "2000"], "-t 2000 is longer than d2c64h4's 1024 positions"),
    (["bench.step", "-r", "3"], "argument -r: invalid choice: 3"),
    # once min() of nothing
    (["bench.checksum", "--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["bench.kernels", "--steps", "x"], ""),   # torch first: without it, its one line
    (["bench.gemms", "--reps", "0"], "argument --reps: must be at least 1, got 0"),
])
def test_a_count_or_length_a_benchmark_cannot_use_is_one_line(args, message):
    proc = python(["-m", *args], cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr


def test_the_kernel_report_sums_idle_gaps_by_the_kernels_around_them_and_shows_the_host_beside_the_longest(
        monkeypatch, capsys):
    """bench/kernels.py's report on a made-up profile (it needs torch only for the profiler, stood in for
    here): two steps whose input copy comes 1.29 and 0.5 ms after the memset before it, and one other gap."""
    import enum
    import importlib.machinery
    import importlib.util
    import types
    torch = types.ModuleType("torch")
    torch.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    device = enum.Enum("DeviceType", "CPU CUDA")
    torch.autograd = types.SimpleNamespace(DeviceType=device)
    profiler = types.ModuleType("torch.profiler")
    profiler.ProfilerActivity, profiler.profile = types.SimpleNamespace(CPU=0, CUDA=1), None
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.profiler", profiler)
    path = os.path.join(REPO, "bench", "kernels.py")
    spec = importlib.util.spec_from_file_location("kernels_on_a_stand_in", path)
    kernels = importlib.util.module_from_spec(spec)   # loaded beside, not as bench.kernels
    spec.loader.exec_module(kernels)

    def event(name, start, end, on=device.CUDA):
        return types.SimpleNamespace(name=name, time_range=types.SimpleNamespace(start=start, end=end),
                                     device_type=on, device_time_total=end - start)
    events = []
    for t0, late in ((0, 1290), (3500, 500)):   # microseconds
        events += [event("adamw", t0, t0 + 1300), event("Memset (Device)", t0 + 1300, t0 + 1310),
                   event("Memcpy HtoD (Pinned -> Device)", t0 + 1310 + late, t0 + 1320 + late),
                   event("flash_forward", t0 + 1320 + late, t0 + 1400 + late),
                   event("cudaMemcpyAsync", t0 + 1300 + late, t0 + 1305 + late, device.CPU)]
    events += [event("gemm", 3000, 3100), event("cudaEventSynchronize", 0, 20, device.CPU)]
    kernels.report(types.SimpleNamespace(events=lambda: events), 2, "made up", 3)
    out = capsys.readouterr().out.splitlines()
    # kernels: 2 x (1.3 + 0.01 + 0.01 + 0.08) + 0.1 ms over 2 steps; idle: 1.29 + 0.5 and the gaps around
    # gemm (3000 - 2690, 3500 - 3100) over 2 steps
    assert out[0] == ("made up: 1.45 ms of kernels a step (attention 0.08, gemm 0.05, other 1.32); "
                      "idle between them 1.25 ms a step")
    heading = ("where the GPU waits, a step (how many gaps in all: the kernel before them -> the kernel "
               "after):")
    gaps = out[out.index(heading) + 1:]
    assert gaps[0] == "    0.895 ms    2x  Memset (Device) -> Memcpy HtoD (Pinned -> Device)"
    assert gaps[1:3] == ["    0.200 ms    1x  gemm -> adamw", "    0.155 ms    1x  flash_forward -> gemm"]
    host = out.index("the longest gap, 1.290 ms, and the host's CUDA calls around it (start and end, ms from "
                     "the gap's start)")
    # the host woke 1.29 ms before the gap began, and copied the ids in only 1.28 ms into it
    assert out[host + 1:] == ["   -1.310    -1.290 ms  cudaEventSynchronize",
                              "   +1.280    +1.285 ms  cudaMemcpyAsync"]
    # kernels back to back: no gap to list, and no host calls set beside one
    tight = [event("a", 0, 10), event("b", 10, 30)]
    kernels.report(types.SimpleNamespace(events=lambda: tight), 1, "tight", 3)
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("idle between them 0.00 ms a step") and out[-1] == heading


class StandInLt:
    """BlasLt's protocol as recording() sees it: matmul(...) plans once per key, in self.plans."""

    def __init__(self):
        self.plans = {}

    def matmul(self, transa, transb, m, n, k, A, lda, B, ldb, D, ldc, beta=0.0, epilogue="none", **pointers):
        key = (transa, transb, m, n, k, lda, ldb, ldc, epilogue)
        self.plans.setdefault(key, [f"plan {len(self.plans)}"])


def test_recording_names_each_calls_plan_and_keeps_the_plans_made_before():
    lt = StandInLt()
    lt.matmul("T", "N", 8, 4, 2, None, 2, None, 2, None, 8)
    first = lt.plans[("T", "N", 8, 4, 2, 2, 2, 8, "none")]
    with recording(lt) as calls:
        lt.matmul("T", "N", 8, 4, 2, None, 2, None, 2, None, 8)                   # planned before
        lt.matmul("N", "N", 2, 4, 8, None, 2, None, 8, None, 2, epilogue="bias")  # new
        lt.matmul("N", "N", 2, 4, 8, None, 2, None, 8, None, 2, epilogue="bias")  # again
    assert [key for _, _, key in calls] == [("T", "N", 8, 4, 2, 2, 2, 8, "none"),
                                            ("N", "N", 2, 4, 8, 2, 8, 2, "bias"),
                                            ("N", "N", 2, 4, 8, 2, 8, 2, "bias")]
    assert calls[1][1] == {"epilogue": "bias"}
    assert len(lt.plans) == 2 and lt.plans[("T", "N", 8, 4, 2, 2, 2, 8, "none")] is first
    assert "matmul" not in vars(lt)   # the class's own method again
