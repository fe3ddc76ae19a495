"""Shared helpers: run train_gpt2.py (alone or under mpiexec) in a scratch directory on tiny synthetic token
shards."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from llm import formats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_gpt2.py")
TINY = ["-e", "d2c64h4", "-b", "4", "-t", "32", "-l", "1e-3", "-s", "0", "-v", "1000", "-m", "2"]
# llm.c's step line, then our ETA; a z-score before its 128-step window fills, and the MFU where the
# device's peak is unknown, read "n/a"
STEP_LINE = re.compile(r"^step +(\d+)/(\d+) \| loss (\d+\.\d{6}) \(([+-]\d+\.\d\dz|z n/a)\)\| "
                       r"norm (\d+\.\d{4}) \(([+-]\d+\.\d\dz|z n/a)\)\| lr (\d\.\d\de[+-]\d\d) \| "
                       r"(\d+\.\d\d) ms \| "
                       r"(\d+\.\d% (?:fp32|bf16) MFU|(?:fp32|bf16) MFU n/a) \| (\d+) tok/s"
                       r" \| ETA (\d+s|\d+m\d\ds|\d+h\d\dm)$")


MPIEXEC = shutil.which("mpiexec", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                         os.environ.get("PATH", "")]))
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpi4py mpich)")


def mpirun(n):
    return [MPIEXEC, "-n", str(n)]


def rank_pids(marker, rank):
    """PIDs of the processes of MPI rank `rank` that have `marker` as one of their arguments (the -o dir)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if marker in args and f"PMI_RANK={rank}" in environ:
            pids.append(int(pid))
    return pids


def env():
    """The environment for a child process: the repo importable, no inherited MPI launch variables."""
    launched = ("PMI_", "OMPI_", "PMIX_", "MPI_LOCALNRANKS")
    e = {k: v for k, v in os.environ.items() if not k.startswith(launched)}
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_train(args, cwd, timeout=300, check=True, launcher=(), train=TRAIN):
    """Run train_gpt2.py (or its copy `train`) with `args` in `cwd`; return the CompletedProcess (stdout,
    stderr as text)."""
    proc = subprocess.run([*launcher, sys.executable, train, *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"train_gpt2.py {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def clone_trainer(directory):
    """train_gpt2.py alone in `directory`, as in a fresh clone: the copy looks for the default files it does
    not find in the current directory (data, model, tokenizer, HellaSwag) there, not in this repository.
    -> its path."""
    os.makedirs(directory, exist_ok=True)
    return shutil.copy2(TRAIN, directory)


def step_losses(stdout):
    """The printed per-step losses, as the exact strings (6 decimals)."""
    return [m.group(3) for line in stdout.splitlines() if (m := STEP_LINE.match(line))]


@pytest.fixture
def shards(tmp_path):
    """A working directory with small train and val shards of random GPT-2 token ids."""
    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "data")
    formats.write_shard(tmp_path / "data" / "train.bin", rng.integers(0, 50257, 8 * 1024 + 1))
    formats.write_shard(tmp_path / "data" / "val.bin", rng.integers(0, 50257, 2 * 1024 + 1))
    return tmp_path


def data_args():
    return ["-i", "data/train.bin", "-j", "data/val.bin"]
