"""Every command ends the same way (llm/launch.py's run): a user's mistake is one line and exit status 1, a
signal or a stdout that cannot be written is one line and a non-zero exit, and a bug shows its traceback."""
import os
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

from llm import REQUIRED, formats
from llm.config import GPT2Config
from llm.weight_init import init_params
from conftest import REPO, TINY, TRAIN, data_args, env

# each command as a user types it, from the repository's root, with a mistake in what it is given
BAD_INPUT = {
    "train_gpt2.py": (["train_gpt2.py", "-zz", "1"], "unknown flag -zz"),
    "test_gpt2.py": (["test_gpt2.py", "--bogus"], "unrecognized arguments: --bogus"),
    "llm.sample": (["-m", "llm.sample", "-e", "missing.bin"], "missing.bin: no such file"),
    "llm.plot": (["-m", "llm.plot", "missing"], "missing/main.log: no such file"),
    "data.tinyshakespeare": (["-m", "data.tinyshakespeare", "--input", "missing.txt"],
                             "missing.txt: no such file"),
    "data.hellaswag": (["-m", "data.hellaswag", "--input", "missing.jsonl"], "missing.jsonl: no such file"),
    "data.fineweb": (["-m", "data.fineweb", "--input", "missing.txt"], "missing.txt: no such file"),
    "data.gpt2": (["-m", "data.gpt2", "--input", "missing"], "missing: no such file"),
    "bench.step": (["-m", "bench.step", "--model", "d7"], "unsupported GPT-2 depth 7"),
    "bench.gpu_ops": (["-m", "bench.gpu_ops", "--reps", "many"], "--reps: needs a whole number, got 'many'"),
    "bench.gemms": (["-m", "bench.gemms", "-t", "2048"], "-t 2048 is longer than d12's 1024 positions"),
    "bench.torch_gpt2": (["-m", "bench.torch_gpt2", "--steps", "many"], ""),   # without torch: one line too
    "bench.kernels": (["-m", "bench.kernels", "--steps", "0"], ""),            # so is this one
}


def python(args, cwd, **kwargs):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=120, **kwargs)


def assert_one_line(stderr, start):
    assert "Traceback" not in stderr and stderr.count("\n") == 1 and stderr.startswith(start), stderr


@pytest.mark.parametrize("command", BAD_INPUT)
def test_every_command_given_a_bad_option_or_file_says_one_line_and_exits_1(command, tmp_path):
    args, message = BAD_INPUT[command]
    args = [os.path.join(REPO, args[0]), *args[1:]] if args[0].endswith(".py") else args
    proc = python(args, cwd=REPO if args[0] == "-m" else tmp_path)   # python -m finds data/ and bench/ here
    assert proc.returncode == 1, proc.stderr
    assert_one_line(proc.stderr, "error: ")
    assert message in proc.stderr


def test_a_plot_format_matplotlib_cannot_write_is_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "main.log").write_text("s:0 trl:10.9 lr:0.0001 norm:1.0\n")
    proc = python(["-m", "llm.plot", "run", "-o", "loss.xyz"], cwd=tmp_path)
    assert proc.returncode == 1
    assert_one_line(proc.stderr, "error: -o loss.xyz: Format 'xyz' is not supported (supported formats: ")


def handlers_installed(proc, timeout=60):
    """Wait until `proc` has installed launch.run's signal handlers (SIGHUP is caught only once it has)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (signal.SIGHUP - 1) & 1:
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def site_packages_but(tmp_path_factory):
    """-> f(*packages): a folder that holds this interpreter's site-packages as links, all but `packages`'."""
    purelib = sysconfig.get_paths()["purelib"]

    def without(*packages):
        folder = tmp_path_factory.mktemp(f"without_{'_'.join(packages)}")
        for name in os.listdir(purelib):
            if name.split("-")[0].split(".")[0] not in packages:   # numpy, numpy-2.4.6.dist-info, numpy.libs
                os.symlink(os.path.join(purelib, name), folder / name)
        return folder
    return without


@pytest.mark.parametrize("command, package", [(command, "tiktoken") for command in BAD_INPUT] +
                         [("train_gpt2.py", package) for package in REQUIRED])
def test_every_command_run_by_a_python_without_a_package_says_to_use_the_venv(command, package,
                                                                              site_packages_but):
    """The system's python instead of .venv/bin/python: one line, not a ModuleNotFoundError traceback.
    python -S leaves site-packages out of sys.path, which then holds this one without `package`."""
    args = BAD_INPUT[command][0]
    args = [os.path.join(REPO, args[0]), *args[1:]] if args[0].endswith(".py") else args
    path = os.pathsep.join([REPO, str(site_packages_but(package))])
    proc = subprocess.run([sys.executable, "-S", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**env(), "PYTHONPATH": path})
    assert proc.returncode == 1
    assert proc.stderr == (f"error: {sys.executable} has no {package}: run the commands with "
                           f".venv/bin/python (`make setup` creates it)\n")


# what a machine without a GPU may hold: cupy that finds no GPU, torch built for the CPU; and transformers'
# names, which hf_check imports before it reads its flags
STAND_INS = {"cupy": {"cupy/__init__.py": "class cuda:\n    is_available = staticmethod(lambda: False)\n"},
             "torch": {"torch/__init__.py": ('__version__ = "2.9.0+cpu"\n\n\nclass cuda:\n'
                                             "    is_available = staticmethod(lambda: False)\n"),
                       "torch/nn/__init__.py": "Module = object\n", "torch/nn/functional.py": "",
                       "torch/profiler.py": "ProfilerActivity = profile = None\n"},
             "transformers": {"transformers/__init__.py": "AutoTokenizer = GPT2LMHeadModel = None\n"}}
ON_A_GPU = "run this benchmark on a machine with a CUDA GPU"
NO_CUPY = f'the cupy backend needs cupy: pip install -e ".[gpu]" (or cupy-cuda13x), or {ON_A_GPU}'
NO_GPU = f"the cupy backend needs a CUDA GPU, and none is usable here: {ON_A_GPU}"
NO_TORCH = "this needs torch (pip install torch), which the project itself never needs"
CPU_TORCH = f"torch 2.9.0+cpu finds no usable CUDA GPU here: {ON_A_GPU} and a CUDA build of torch"


@pytest.mark.parametrize("args, stand_ins, message", [
    # once "..., or use --backend numpy", a flag they do not have
    (["bench.gemms"], (), NO_CUPY), (["bench.gpu_ops"], (), NO_CUPY),
    (["bench.gemms"], ("cupy",), NO_GPU), (["bench.gpu_ops"], ("cupy",), NO_GPU),
    (["bench.kernels"], ("torch",), CPU_TORCH),   # once a traceback, or cupy's line with --backend numpy
    (["bench.kernels"], (), NO_TORCH), (["bench.torch_gpt2"], (), NO_TORCH),
    (["bench.torch_gpt2"], ("torch",), CPU_TORCH),   # once a traceback
    (["bench.hf_check"], (), "this needs torch and transformers (pip install torch transformers), which the "
                             "project itself never needs"),
    (["bench.hf_check", "--tol", "-1"], ("torch", "transformers"),   # once every check NOT OK
     "argument --tol: needs a finite number above 0, got '-1' (--help lists the flags)"),
])
def test_every_benchmark_of_the_gpu_or_of_torch_says_in_one_line_what_this_machine_lacks(
        args, stand_ins, message, site_packages_but, tmp_path):
    """Run with none of cupy, torch and transformers but the stand-ins for them that a test names."""
    for package in stand_ins:
        for name, text in STAND_INS[package].items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
    path = os.pathsep.join([REPO, str(tmp_path), str(site_packages_but(*STAND_INS))])
    proc = subprocess.run([sys.executable, "-S", "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**env(), "PYTHONPATH": path})
    assert (proc.returncode, proc.stderr) == (1, f"error: {message}\n")


HELP_ELSEWHERE = ("train_gpt2.py", "bench.torch_gpt2", "bench.kernels")   # see the docstring below


@pytest.mark.parametrize("command", [command for command in BAD_INPUT if command not in HELP_ELSEWHERE])
def test_every_commands_help_says_what_it_does_in_whole_sentences(command):
    """The description under the usage, from the module's docstring (bench's once stopped mid-sentence).
    train_gpt2.py's --help is llm.c's list of flags; bench.torch_gpt2 and bench.kernels need torch."""
    args = BAD_INPUT[command][0]
    args = [os.path.join(REPO, args[0])] if args[0].endswith(".py") else args[:2]
    proc = python([*args, "--help"], cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    description = proc.stdout.split("\n\n")[1]
    assert description.rstrip().endswith("."), description


@pytest.fixture(scope="module")
def long_sample(tmp_path_factory):
    """python -m llm.sample that runs for a while: 1,000 tokens from a small model with a window of 1,024."""
    folder = tmp_path_factory.mktemp("sample")
    config = GPT2Config(vocab_size=96, padded_vocab_size=128, num_layers=2, num_heads=2, channels=32)
    formats.write_model(folder / "model.bin", config, init_params(config))
    formats.write_tokenizer(folder / "tokenizer.bin", [bytes([c]) for c in range(32, 127)] + [b"<eot>"], 95)
    return folder, ["-m", "llm.sample", "-e", "model.bin", "--tokenizer", "tokenizer.bin",
                    "--backend", "numpy", "-n", "1000"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("command", ["llm.sample", "data.tinyshakespeare"])
def test_a_signal_stops_every_long_running_command_with_one_line(command, sig, tmp_path, long_sample):
    if command == "llm.sample":
        cwd, args = long_sample
    else:   # waits at its input, a named pipe that nothing writes
        os.mkfifo(tmp_path / "input.txt")
        cwd, args = tmp_path, ["-m", command, "--input", "input.txt", "--out", str(tmp_path)]
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert handlers_installed(proc), proc.communicate()
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stdout, stderr) == (128 + sig, "", f"stopped by {sig.name}\n")


def test_a_signal_that_arrives_while_a_class_is_made_stops_with_one_line(tmp_path):
    """The SystemExit that stops the command is raised where the signal finds it. Inside a class body's
    __set_name__ (threadpoolctl's dataclass, as it loads), Python 3.11 wraps it in a RuntimeError, which
    run() once reported as a bug, with its traceback."""
    code = ("import os, signal\n"
            "from llm.launch import run\n"
            "class Field:\n"
            "    def __set_name__(self, owner, name):\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "def main(argv):\n"
            "    class Holder:\n"
            "        field = Field()\n"
            "run(main)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (143, "", "stopped by SIGTERM\n")


def train_args(steps):
    return [sys.executable, TRAIN, *TINY, *data_args(), "-x", str(steps)]


def test_training_into_head_stops_with_one_line(shards):
    """`| head -1` closes the pipe after the first line: once a BrokenPipeError traceback, at the next
    print."""
    command = " ".join(train_args(200)) + " | head -1; exit ${PIPESTATUS[0]}"
    proc = subprocess.run(["bash", "-c", command], cwd=shards, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("+---")
    assert proc.returncode == 128 + signal.SIGPIPE
    assert proc.stderr == "stopped: the reader of stdout has gone (broken pipe)\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["train", "sample"])
def test_stdout_on_a_full_disk_is_one_line(command, shards, long_sample):
    with open("/dev/full", "w") as full:
        if command == "train":
            proc = subprocess.run(train_args(2), cwd=shards, env=env(), stdout=full, stderr=subprocess.PIPE,
                                  text=True, timeout=300)
        else:
            cwd, args = long_sample
            proc = subprocess.run([sys.executable, *args[:-1], "20"], cwd=cwd, env=env(), stdout=full,
                                  stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr == "error: cannot write stdout (No space left on device)\n"


CRASH = """
import runpy, sys
import llm.step

def crash(*args, **kwargs):
    raise RuntimeError("an unexpected bug")

llm.step.train_step = crash   # train_gpt2.py imports it from llm.step, and gets this one
sys.argv[0] = {train!r}
runpy.run_path({train!r}, run_name="__main__")
"""


def test_a_bug_in_main_still_shows_its_traceback(shards):
    proc = subprocess.run([sys.executable, "-c", CRASH.format(train=TRAIN), *TINY, *data_args(), "-x", "2"],
                          cwd=shards, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert proc.stderr.rstrip().endswith("RuntimeError: an unexpected bug")


def test_help_is_shown_for_h_alone_help_and_dash_help(tmp_path):
    for flag in ("-h", "--help", "-help"):
        proc = python([TRAIN, flag], cwd=tmp_path)
        assert proc.returncode == 0 and proc.stderr == ""
        assert proc.stdout.startswith("Usage: python train_gpt2.py")
        assert "  -h              HellaSwag" in proc.stdout


def test_a_repeated_flag_and_a_warmup_longer_than_the_run_get_a_warning_line(shards):
    proc = python([TRAIN, *TINY, *data_args(), "-x", "2", "-u", "5", "-b", "2"], cwd=shards)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
    assert lines == ["warning: -b is given 2 times: the last, -b 2, counts",
                     "warning: -u 5: the warmup is longer than the run's 2 steps, so the learning rate never "
                     "reaches -l 0.001"]
