"""The quick start: `make train` prepares tiny Shakespeare and trains a small model whose loss clearly falls;
a second `make train` says how to start anew or resume, and RESUME=1 resumes. `make clean`, a SHARED= folder
without the files, and `make test`'s temporary folders.

The tests run the Makefile's own recipes, with fewer steps, in a copy of the sources: the user's log_train/,
data and tokenizer file are never touched."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, STEP_LINE, env

SHARED = os.path.join(REPO, "..", "shared", "data")
have_data = os.environ.get("GPT2_VOCAB") or os.path.exists(os.path.join(SHARED, "gpt2.tiktoken"))
# SHARED= where it holds both files (make refuses one that does not), else the environment's files
SHARED_ARG = [f"SHARED={os.path.abspath(SHARED)}"] if all(
    os.path.exists(os.path.join(SHARED, name)) for name in ("gpt2.tiktoken", "tinyshakespeare.txt")) else []
STEPS = 50    # of make train's 250: the loss is below 6.5 by then
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
# the venv and the data taken as made, for the recipes that need neither
MADE = ["-o", ".venv/.installed", "-o", "data/tinyshakespeare/tiny_shakespeare_train.bin"]


def make(args, cwd):
    return subprocess.run(["make", "-s", *args], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=900)


def make_error(proc):
    """make stopped with one line of its own ("Makefile:N: *** ...  Stop.") -> what the line says."""
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stderr.split("*** ", 1)[1]


def copy_sources(dest):
    """What `make train` reads: the Makefile, the trainer, llm/ and the data scripts."""
    os.makedirs(dest / "data")
    for name in ("Makefile", "pyproject.toml", "train_gpt2.py"):
        shutil.copy2(os.path.join(REPO, name), dest / name)
    shutil.copytree(os.path.join(REPO, "llm"), dest / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    for script in glob.glob(os.path.join(REPO, "data", "*.py")):
        shutil.copy2(script, dest / "data")


@needs_make
@pytest.mark.skipif(not have_data, reason="needs a local gpt2.tiktoken (GPT2_VOCAB or ../shared/data)")
def test_make_train_loss_falls_and_prints_a_decoded_sample_and_resumes_with_resume_1(tmp_path):
    copy_sources(tmp_path)
    # this interpreter instead of .venv's, and the venv taken as installed: the copy has none of its own
    args = ["-o", ".venv/.installed", f"PY={sys.executable}", *SHARED_ARG, f"TRAIN_STEPS={STEPS}", "train"]
    proc = make(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [float(m.group(3)) for line in proc.stdout.splitlines() if (m := STEP_LINE.match(line))]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 4.0, (losses[0], losses[-1])   # from ~10.9 to below 7
    sample = proc.stdout.split("generating:\n---\n")[-1].split("\n---")[0]
    assert len(re.findall(r"[A-Za-z]{3,}", sample)) >= 5, sample     # words, not token ids
    assert os.path.exists(tmp_path / "log_train" / f"model_{STEPS:08d}.bin")   # for python -m llm.sample

    # again: make's own line says what make can do (the trainer's would say -y 1, which make cannot pass)
    assert make_error(make(args, tmp_path)) == (
        "log_train holds an earlier run: rm -rf log_train to train anew, or make train RESUME=1 to resume it "
        "(with TRAIN_STEPS=500: on to step 500).  Stop.\n")
    proc = make([*args[:-2], f"TRAIN_STEPS={STEPS + 2}", "RESUME=1", "train"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resuming from checkpoint at step {STEPS} in log_train" in proc.stdout
    assert [int(m.group(1)) for line in proc.stdout.splitlines() if (m := STEP_LINE.match(line))] == \
        [STEPS + 1, STEPS + 2]


@needs_make
def test_a_shared_folder_without_the_files_is_one_line_from_make(tmp_path):
    shutil.copy2(os.path.join(REPO, "Makefile"), tmp_path)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "gpt2.tiktoken").write_text("")
    line = make_error(make(["-o", ".venv/.installed", "SHARED=missing", "data"], tmp_path))
    assert line == ("SHARED=missing: no such folder: make takes tinyshakespeare.txt and gpt2.tiktoken from "
                    "it.  Stop.\n")
    line = make_error(make(["-o", ".venv/.installed", "SHARED=shared", "data"], tmp_path))
    assert line.startswith("SHARED=shared: no tinyshakespeare.txt there: ")
    assert not (tmp_path / "data").exists()


@needs_make
@pytest.mark.parametrize("variable, message", [
    ("TRAIN_STEPS=abc", "TRAIN_STEPS=abc: the steps to train to, a whole number of 1 or more.  Stop.\n"),
    ("TRAIN_STEPS=0", "TRAIN_STEPS=0: the steps to train to, a whole number of 1 or more.  Stop.\n"),
    ("RESUME=2", "RESUME=2: 1 resumes the run in log_train, 0 (the default) starts one.  Stop.\n")])
def test_a_wrong_make_variable_is_named_before_anything_runs(tmp_path, variable, message):
    """The trainer's own line would name -x or -y, which make's user never typed."""
    shutil.copy2(os.path.join(REPO, "Makefile"), tmp_path)
    assert make_error(make([variable, "train"], tmp_path)) == message
    assert os.listdir(tmp_path) == ["Makefile"]
    assert make(["-n", variable, "clean"], tmp_path).returncode == 0   # only train reads them


@needs_make
def test_make_clean_removes_what_make_wrote_and_nothing_else(tmp_path):
    shutil.copy2(os.path.join(REPO, "Makefile"), tmp_path)
    made = [".venv/bin/python", "llm_py.egg-info/PKG-INFO", "data/tinyshakespeare/tiny_shakespeare_val.bin",
            "gpt2_tokenizer.bin", "log_train/main.log"]
    kept = ["data/tinyshakespeare.py", "data/hellaswag/hellaswag_val.bin", "gpt2_124M.bin", "log_d6/main.log"]
    for name in made + kept:
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        (tmp_path / name).write_text("")
    assert make(["clean"], tmp_path).returncode == 0
    left = sorted(os.path.relpath(os.path.join(d, f), tmp_path)
                  for d, _, files in os.walk(tmp_path) for f in files)
    assert left == sorted(kept + ["Makefile"])


PASSING = """
def test_writes_a_gigabyte_in_a_real_run(tmp_path):
    (tmp_path / "big.bin").write_bytes(bytes(1000))
"""


def test_passing_tests_leave_no_temporary_folders(tmp_path):
    """make test once left 2.2 GB in pytest's folder, and three runs of it: pyproject.toml's retention
    settings keep nothing of a passing test. A pytest run with those settings, in a folder of its own."""
    shutil.copy2(os.path.join(REPO, "pyproject.toml"), tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_passing.py").write_text(PASSING)
    (tmp_path / "temp").mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=tmp_path,
                          env={**env(), "PYTEST_DEBUG_TEMPROOT": str(tmp_path / "temp")}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "temp") for f in files]
    assert left == []
