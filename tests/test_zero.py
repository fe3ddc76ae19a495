"""ZeRO over MPI on the CPU: sharded training equals unsharded training, at any number of ranks."""
import ast
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from llm import checkpoint, formats
from conftest import (REPO, TINY, TRAIN, data_args, env, mpirun, needs_mpiexec, rank_pids, run_train,
                      step_losses)

pytestmark = needs_mpiexec
D = ["-d", str(6 * 4 * 32)]   # total batch: 6 sequences, so 1, 2 and 3 ranks all divide it


def params_after(directory, step):
    return formats.read_model(checkpoint.model_path(directory, step))[1]


def train(shards, n, zero, out, extra=()):
    args = (TINY[:2] + ["-b", str(6 // n)] + TINY[4:] + data_args() + D
            + ["-z", str(zero), "-x", "10", "-n", "10", "-o", out, *extra])
    return run_train(args, cwd=shards, launcher=mpirun(n) if n > 1 else ())


def assert_close(a, b, rtol):
    """Relative agreement of two parameter (or loss) vectors: |a - b| / |b| in the 2-norm."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < rtol


def test_two_ranks_with_zero1_equal_one_rank(shards):
    one = train(shards, 1, 0, "one").stdout
    two = train(shards, 2, 1, "two").stdout
    assert "| Zero Stage1 is enabled" in two and "| num_processes         | 2 " in two
    P = 3385088 * 4   # d2c64h4's fp32 bytes: the optimizer state halves on two ranks
    assert f"allocated {P >> 20} MiB for AdamW optimizer state m" in one
    assert f"allocated {(P // 2) >> 20} MiB for AdamW optimizer state v" in two
    l1, l2 = [float(x) for x in step_losses(one)], [float(x) for x in step_losses(two)]
    assert len(l1) == len(l2) == 10
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    assert_close(params_after(shards / "two", 10), params_after(shards / "one", 10), 1e-5)


@pytest.mark.parametrize("n", [2, 3])
def test_zero0_and_zero1_agree(shards, n):
    z0 = train(shards, n, 0, f"z0_{n}").stdout
    z1 = train(shards, n, 1, f"z1_{n}").stdout
    np.testing.assert_allclose([float(x) for x in step_losses(z1)], [float(x) for x in step_losses(z0)],
                               rtol=1e-5)
    assert_close(params_after(shards / f"z1_{n}", 10), params_after(shards / f"z0_{n}", 10), 1e-5)


def test_optimizer_state_per_rank_is_one_nth(shards):
    """m and v bytes on each rank are ceil(P/N)*4, for an N that does not divide P."""
    script = os.path.join(REPO, "tests", "mpi_shards.py")
    out = subprocess.run(mpirun(3) + [sys.executable, script, "d2c64h4"],
                         env=env(), capture_output=True, text=True, timeout=120, check=True).stdout
    P, sizes = out.split(" ", 1)
    P, sizes = int(P), ast.literal_eval(sizes)
    assert P % 3 != 0
    S = math.ceil(P / 3)
    assert [(m, v) for m, v, _, _ in sizes] == [(4 * S, 4 * S)] * 3
    assert [(lo, hi) for _, _, lo, hi in sizes] == [(0, S), (S, 2 * S), (2 * S, 3 * S)]


def test_checkpoint_from_two_ranks_resumes_on_one_and_three(shards):
    args = TINY[:2] + TINY[4:] + data_args() + D + ["-z", "1", "-x", "8", "-n", "4"]
    full = step_losses(run_train(["-b", "3"] + args + ["-o", "full"], cwd=shards, launcher=mpirun(2)).stdout)
    for n in (1, 3):
        shutil.copytree(shards / "full", shards / f"from2_{n}")
        checkpoint.delete(shards / f"from2_{n}", 8)
        out = run_train(["-b", str(6 // n)] + args + ["-o", f"from2_{n}", "-y", "1"], cwd=shards,
                        launcher=mpirun(n) if n > 1 else ()).stdout
        assert "resuming from checkpoint at step 4" in out
        np.testing.assert_allclose([float(x) for x in step_losses(out)], [float(x) for x in full[4:]],
                                   rtol=1e-5)


def test_every_rank_falls_back_with_rank_0_past_a_damaged_checkpoint(shards):
    args = TINY[:2] + ["-b", "3"] + TINY[4:] + data_args() + D + ["-z", "1", "-x", "6", "-n", "2", "-o", "ck"]
    full = step_losses(run_train(args, cwd=shards, launcher=mpirun(2)).stdout)
    checkpoint.delete(shards / "ck", 6)
    with open(checkpoint.state_path(shards / "ck", 4), "r+b") as f:   # one word of m
        f.seek(5000)
        f.write(bytes(4))
    out = run_train(args + ["-y", "1"], cwd=shards, launcher=mpirun(2)).stdout
    assert "WARNING: skipping the damaged checkpoint at step 4, resuming from step 2: " in out
    assert "resuming from checkpoint at step 2" in out and step_losses(out) == full[2:]


@pytest.mark.parametrize("elsewhere", ["no -o", "another copy of -o"])
def test_a_rank_that_sees_another_output_dir_stops_every_rank_with_one_line(shards, elsewhere):
    """Rank 0 resumes; rank 1 runs where -o is missing (a node that does not see it: the job once hung
    with no message) or holds a state file of other bytes (it once resumed elsewhere in the data)."""
    args = TINY[:2] + ["-b", "3"] + TINY[4:] + data_args() + D + ["-z", "1", "-n", "2", "-o", "ck"]
    run_train(args + ["-x", "2"], cwd=shards, launcher=mpirun(2))
    node = shards / "node1"
    os.makedirs(node)
    os.symlink(shards / "data", node / "data")
    if elsewhere == "another copy of -o":   # a checkpoint of a run with another -l: intact, other bytes
        lr = args.index("-l") + 1
        run_train(args[:lr] + ["2e-3"] + args[lr + 1:] + ["-x", "2"], cwd=node, launcher=mpirun(2))
        size = os.path.getsize(checkpoint.model_path(node / "ck", 2))
        problem = (rf"ck/model_00000002\.bin: {size} bytes, checksum [0-9a-f]{{16}} here, {size} bytes, "
                   rf"checksum [0-9a-f]{{16}} on rank 0")
    else:
        problem = r"ck/model_00000002\.bin: no such file"
    elsewhere_py = os.path.join(REPO, "tests", "mpi_elsewhere.py")
    proc = subprocess.run(mpirun(2) + [sys.executable, elsewhere_py, str(node), *args, "-x", "4", "-y", "1"],
                          cwd=shards, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(rf"rank 0: error: rank 1 cannot resume the checkpoint at step 2 as rank 0 does "
                        rf"\({problem}\): every rank must see the same -o ck", proc.stderr.strip()), \
        proc.stderr


def test_killing_one_rank_stops_the_run_in_bounded_time(shards):
    args = TINY[:2] + ["-b", "3"] + TINY[4:] + data_args() + D + ["-z", "1", "-x", "100000", "-o", "killme"]
    proc = subprocess.Popen(mpirun(2) + [sys.executable, TRAIN, *args], cwd=shards, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not os.path.exists(shards / "killme" / "main.log"):
        time.sleep(0.2)
    time.sleep(1.0)
    pids = rank_pids("killme", 1)
    assert pids, "rank 1 not found"
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.time()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not stop within 30 s of losing a rank")
    assert proc.returncode != 0
    assert time.time() - t0 < 30
    assert not rank_pids("killme", 0), "rank 0 is still running"


class ShardOnlyComm:
    """Rank `rank` of `world_size`, with the collectives an update needs done for this rank alone."""
    name = "test"

    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size

    def reduce_scatter_avg(self, flat, shard):
        pass   # the shard is already this rank's slice of flat

    def all_gather(self, shard, flat):
        pass


def test_zero1_over_a_padded_model_updates_every_parameter_and_refuses_an_unpadded_one():
    """P = 3,385,088 does not divide by 3: the model is built with buffers padded to a multiple of 3,
    and the three shards together update every parameter, the last one included. A model built without
    the padding is refused, not resized under its owner."""
    from llm.backends import get_backend
    from llm.config import GPT2Config
    from llm.model import GPT2
    from llm.zero import StepStats, ZeroOptimizer, padded_size
    config = GPT2Config.from_descriptor("d2c64h4")
    P = config.num_parameters
    assert P % 3 != 0
    with pytest.raises(ValueError, match="needs flat buffers of"):
        ZeroOptimizer(GPT2(config, get_backend("numpy")), ShardOnlyComm(0, 3), zero_stage=1, weight_decay=0.0)
    updated = np.zeros(P, bool)
    for rank in range(3):
        model = GPT2(config, get_backend("numpy"), flat_size=padded_size(P, 3, zero_stage=1))
        assert model.params_flat.size == 3 * math.ceil(P / 3)   # padded as built
        optimizer = ZeroOptimizer(model, ShardOnlyComm(rank, 3), zero_stage=1, weight_decay=0.0)
        assert model.params_flat.size == 3 * math.ceil(P / 3)   # and left as it was
        assert optimizer.hi - optimizer.lo == math.ceil(P / 3)
        model.grads_flat[...] = 1.0
        before = model.params_numpy()
        stats = np.array([1.0, 0.5], np.float32)   # loss sum, norm^2: no clipping
        optimizer.update(lr=1e-3, t=1, stats=StepStats(stats, lambda: stats))
        changed = model.params_numpy() != before
        assert not changed[:optimizer.lo].any() and not changed[optimizer.hi:].any()
        updated |= changed
    assert updated.all()
