"""Nothing lost, nothing hung, no traceback: train_gpt2.py against bad flags, bad files, signals, full disks,
a second run in the same directory, and runs that diverge. Each bad input gets one line and a non-zero
exit."""
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash

from llm import checkpoint, formats
from llm.backends import gpu_missing
from llm.config import GPT2Config
from llm.weight_init import init_params
import train_gpt2   # (importing it installs nothing: that happens under __main__ only)
from conftest import (MPIEXEC, REPO, TINY, TRAIN, data_args, env, mpirun, needs_mpiexec, rank_pids,
                      run_train, step_losses)

P = 3385088   # d2c64h4's parameters


def assert_one_line_error(proc, message, code=1):
    """Exit `code`, no traceback, and stderr's first line is the error, saying `message`."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_an_output_place_that_cannot_be_written_is_named_with_its_flag_before_any_work(tmp_path):
    from llm.launch import UserError, output_dir, output_file
    a_file = tmp_path / "a file"
    a_file.write_text("")
    cases = [(output_dir, a_file, "--out", "exists and is not a folder: name a folder"),
             (output_dir, a_file / "sub", "--out", "a part of the path is a file"),
             (output_file, tmp_path, "--tokenizer", "is a folder: name a file"),
             (output_file, a_file / "tok.bin", "--tokenizer", "a part of the path is a file")]
    if os.geteuid() != 0:   # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases.append((output_dir, locked / "out", "--out", "cannot write there (Permission denied)"))
    for check, path, flag, message in cases:
        with pytest.raises(UserError, match=re.escape(f"{flag} {path}: {message}")):
            check(str(path), flag)
    assert output_dir(str(tmp_path / "new" / "out")) == str(tmp_path / "new" / "out")
    assert sorted(os.listdir(tmp_path)) == ["a file"]   # nothing made: the file that tried it is gone
    assert output_file(str(tmp_path / "t.bin"), "--tokenizer") == str(tmp_path / "t.bin")


# ---------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag, value, message", [
    ("-b", "0", "-b 0: must be positive"),
    ("-t", "0", "-t 0: must be positive"),
    ("-t", "-5", "-t -5: must be positive"),
    ("-l", "nan", "-l nan: must be a finite number"),
    ("-l", "inf", "-l inf: must be a finite number"),
    ("-l", "-1e-3", "-l -1e-3: must be 0 or more"),
    ("-q", "1.5", "-q 1.5: must be between 0 and 1"),
    ("-q", "-0.1", "-q -0.1: must be between 0 and 1"),
    ("-q", "nan", "-q nan: must be a finite number"),
    ("-c", "-inf", "-c -inf: must be a finite number"),
    ("-c", "-0.1", "-c -0.1: must be 0 or more"),
    ("-sl", "nan", "-sl nan: must be a finite number"),
    ("-sg", "-1", "-sg -1: must be 0 or more"),
    ("-x", "-5", "-x -5: must be positive, or -1"),
    ("-x", "0", "-x 0: must be positive, or -1"),
    ("-d", "-2", "-d -2: must be positive, or -1"),
    ("-d", "0", "-d 0: must be positive, or -1"),
    ("-m", "0", "-m 0: must be positive, or -1"),
    ("-v", "0", "-v 0: must be positive"),
    ("-u", "-1", "-u -1: must be 0 or more"),
    ("-n", "-1", "-n -1: must be 0 or more"),
    ("-nk", "-1", "-nk -1: must be 0 or more"),
    ("-s", "-1", "-s -1: must be 0 or more"),
    ("-y", "2", "-y 2: must be one of 0, 1"),
    ("-a", "2", "-a 2: must be one of 0, 1"),
    ("-z", "2", "-z 2: must be one of 0, 1"),
    ("-r", "3", "-r 3: must be one of 0, 1, 2"),
    ("-k", "cosin", "-k cosin: must be one of cosine, linear, constant, wsd"),
    ("--backend", "gpu", "--backend gpu: must be one of auto, numpy, cupy"),
    ("--max-nonfinite", "-1", "--max-nonfinite -1: must be 0 or more"),
])
def test_every_flag_value_is_checked_before_anything_runs(flag, value, message):
    with pytest.raises(train_gpt2.UsageError, match=re.escape(message)):
        train_gpt2.parse_args([flag, value])


@pytest.mark.parametrize("flag, advice", [
    ("-ge", "GELU fusion through cuBLASLt, which the bf16 path here always does: leave it out"),
    ("-lg", "NVML's GPU readings every N steps: leave it out, and watch nvidia-smi"),
    ("-pi", "multi-node set-up without MPI: leave it out, and start the ranks with mpirun or srun"),
    ("-pn", "multi-node set-up without MPI"),
])
def test_llmc_flags_with_no_use_here_say_what_to_do_instead(flag, advice):
    """A command copied from llm.c once got only "unknown flag -ge"."""
    with pytest.raises(train_gpt2.UsageError, match=re.escape(f"{flag} is llm.c's {advice}")):
        train_gpt2.parse_args(["-b", "4", flag, "1"])
    assert set(train_gpt2.LLMC_ONLY).isdisjoint(train_gpt2.FLAGS)


def test_checkpoint_flags_need_an_output_dir():
    for flag in ("-n", "-nk", "-nm", "-y"):
        with pytest.raises(train_gpt2.UsageError, match=f"{flag} 1 needs -o"):
            train_gpt2.parse_args([flag, "1"])


def test_flags_that_are_fine_pass():
    s = train_gpt2.parse_args(["-x", "-1", "-d", "-1", "-m", "-1", "-q", "0", "-l", "0", "-o", "out",
                               "-y", "1"])
    assert (s.max_steps, s.total_batch_size, s.val_max_steps, s.final_learning_rate_frac, s.learning_rate,
            s.resume) == (-1, -1, -1, 0.0, 0.0, 1)


@pytest.mark.parametrize("args, message", [
    (["-b", "0"], "error: -b 0: must be positive"),                      # a ZeroDivisionError once
    (["-l", "nan"], "error: -l nan: must be a finite number"),           # all-NaN parameters and exit 0 once
    (["-i", "data/missing.bin"], "no files match -i/-j pattern 'data/missing.bin'"),
    (["-i", "data"], "-i/-j pattern 'data' matches the folder data: name the shard files in it, as "
                     "data/*train*.bin for -i and data/*val*.bin for -j"),
    (["-zz", "1"], "unknown flag -zz"),
    (["-b"], "flag -b has no value"),
    (["-o", "-b", "4"], "flag -o has no value, it is followed by the flag -b"),   # "flag 4 has no value" once
    (["-b", "four"], "flag -b needs int value, got 'four'"),
    (["-d", "1000"], "total batch size -d 1000 is not divisible by B*T*N = 4*32*1 = 128"),
    (["-t", "2048"], "-t 2048 exceeds the model's max_seq_len 1024"),
    (["-e", "d7"], "unsupported GPT-2 depth 7"),
    (["-e", "foo"], "or dLcChNH (e.g. d2c64h4), or a model file (.bin)"),   # -e takes both; --model not
    (["-e", "nothere.bin"], "nothere.bin: no such file"),
    (["-o", "data/train.bin"], "-o data/train.bin: exists and is not a folder: name a folder"),
    (["-o", "data/train.bin/sub"], "-o data/train.bin/sub: a part of the path is a file, not a folder"),
])
def test_bad_input_gets_one_clear_line(shards, args, message):
    proc = run_train(TINY + data_args() + ["-x", "1"] + args, cwd=shards, check=False)
    assert_one_line_error(proc, message)
    assert proc.stderr.startswith("error: ")


def test_an_epoch_shorter_than_one_step_is_refused_and_val_batches_are_capped_at_the_split(shards):
    """One epoch (-x -1) of 8192 tokens with -d 65536 was 0 steps: a run that trained nothing and exited 0.
    -m beyond the val split's 16 batches read batches twice."""
    proc = run_train(TINY + data_args() + ["-d", str(65536)], cwd=shards, check=False)
    assert_one_line_error(proc, "error: one epoch of 'data/train.bin' (8192 tokens) is less than one step's "
                                "total batch of 65536: use a smaller -d, or -x")
    out = run_train(TINY + data_args() + ["-x", "1", "-m", "1000"], cwd=shards).stdout
    assert re.search(r"^\| val_num_batches +\| 16 +\|$", out, re.M)


@pytest.mark.skipif(not gpu_missing(), reason="the cupy backend can run here")
def test_the_cupy_backend_without_cupy_or_a_gpu_is_one_line(shards):
    proc = run_train(TINY + data_args() + ["-x", "1", "--backend", "cupy"], cwd=shards, check=False)
    assert_one_line_error(proc, f"error: {gpu_missing()}")


# ---------------------------------------------------------------------------------------------- files

def write_tiny_model(path, poison=None, config=None):
    config = config or GPT2Config.from_descriptor("d2c64h4")
    params = init_params(config) if config.vocab_size == 50257 else \
        np.random.default_rng(0).normal(0, 0.02, config.num_parameters).astype(np.float32)
    if poison is not None:
        params[10] = poison
    formats.write_model(path, config, params)
    return config, params


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_model_file_holding_nan_or_inf_is_refused_at_load(shards, poison):
    write_tiny_model(shards / "poisoned.bin", poison)
    proc = run_train(["-e", "poisoned.bin"] + TINY[2:] + data_args() + ["-x", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, "error: poisoned.bin: the model holds NaN or infinite values (1, the first "
                                "in wte)")


def poke(a, i, x):
    a = a.copy()
    a[i] = x
    return a


@pytest.mark.parametrize("damage, message", [
    (lambda s: dict(m=poke(s["m"], 5, np.nan)), "m holds NaN or infinite values (1, the first at index 5)"),
    (lambda s: dict(v=poke(s["v"], 7, -1.0)), "v holds negative values (1)"),
    # once resumed at step 3, one step of data and schedule skipped
    (lambda s: dict(step=3), "holds the state of step 3, not of step 2 as its name says"),
    # once a ValueError traceback
    (lambda s: dict(loss_window=[1.0] * 200), "an outlier window holds at most 128 values, got 200"),
    # once a line that did not say which file
    (lambda s: dict(loader_state=(0, 10**6)),
     "loader state (epoch 0, position 1000000) does not fit 'data/train.bin'"),
])
def test_a_state_file_holding_garbage_is_refused_at_resume(shards, damage, message):
    run_train(TINY + data_args() + ["-x", "2", "-n", "2", "-o", "ck"], cwd=shards)
    path = checkpoint.state_path(shards / "ck", 2)
    state = formats.read_state(path, P)
    formats.write_state(path, **{**dict(step=2, num_processes=1, rng_state=0,
                                        loader_state=state["loader_state"], m=state["m"], v=state["v"]),
                                 **damage(state)})
    proc = run_train(TINY + data_args() + ["-x", "4", "-o", "ck", "-y", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, f"error: {os.path.join('ck', 'state_00000002.bin')}: {message}")


@pytest.mark.parametrize("flag", ["-e", "-i"])
def test_a_pipe_where_a_file_belongs_is_refused_not_waited_on(shards, flag):
    """open() of a named pipe waits for a writer: the run once hung there before printing anything."""
    os.mkfifo(shards / "pipe.bin")
    proc = run_train(TINY + data_args() + ["-x", "1", flag, "pipe.bin"], cwd=shards, check=False, timeout=60)
    assert_one_line_error(proc, "error: pipe.bin: not a file")


def test_a_tokenizer_of_another_vocab_is_refused_at_start(shards):
    """Once a crash at the first sample, after the first -s steps of training."""
    formats.write_tokenizer(shards / "gpt2_tokenizer.bin", [b"x%d" % i for i in range(1000)], 999)
    proc = run_train(TINY[:-8] + ["-v", "1000", "-m", "2", "-s", "5"] + data_args() + ["-x", "5"], cwd=shards,
                     check=False)
    assert_one_line_error(proc, "gpt2_tokenizer.bin: vocab mismatch: tokenizer has 1000 tokens, model "
                                "expects 50257")
    assert "step " not in proc.stdout


def write_hellaswag(directory, largest_id):
    rng = np.random.default_rng(1)
    examples = [dict(label=int(rng.integers(4)), context=list(rng.integers(0, 1000, 5)),
                     completions=[list(rng.integers(0, 1000, 3)) for _ in range(4)]) for _ in range(3)]
    examples[2]["completions"][1][0] = largest_id
    os.makedirs(directory / "data" / "hellaswag")
    formats.write_eval(directory / "data" / "hellaswag" / "hellaswag_val.bin", examples)


@pytest.mark.parametrize("largest_id", [50257, 65000])   # a padding row of wte, past every row of wte
def test_hellaswag_ids_beyond_the_vocab_are_refused_at_start(shards, largest_id):
    write_hellaswag(shards, largest_id)
    proc = run_train(TINY + data_args() + ["-x", "2", "-v", "1", "-h", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, f"example 2 has token id {largest_id}, >= the model's vocab size 50257")
    assert "step " not in proc.stdout


def test_a_hellaswag_file_without_examples_is_refused_at_start(shards):
    """Once a ZeroDivisionError traceback at the first eval: 0 correct out of 0."""
    os.makedirs(shards / "data" / "hellaswag")
    formats.write_eval(shards / "data" / "hellaswag" / "hellaswag_val.bin", [])
    proc = run_train(TINY + data_args() + ["-x", "2", "-h", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, "error: data/hellaswag/hellaswag_val.bin: holds no examples: write it anew "
                                "with python -m data.hellaswag")
    assert "step " not in proc.stdout


def test_a_model_with_its_own_vocab_samples_and_evaluates_with_its_own_eot(shards):
    """V = 1000: samples start from the tokenizer's EOT, or V - 1 without one, and HellaSwag pads with it
    (both were GPT-2's 50256 once: an index error at the first sample or eval)."""
    config = GPT2Config(num_layers=2, num_heads=4, channels=64, vocab_size=1000, padded_vocab_size=1024)
    write_tiny_model(shards / "small.bin", config=config)
    rng = np.random.default_rng(0)
    formats.write_shard(shards / "data" / "train.bin", rng.integers(0, 1000, 8 * 1024 + 1))
    formats.write_shard(shards / "data" / "val.bin", rng.integers(0, 1000, 2 * 1024 + 1))
    write_hellaswag(shards, 999)
    args = ["-e", "small.bin"] + TINY[2:-8] + ["-v", "1", "-m", "2", "-s", "2", "-g", "5"] + data_args()
    out = run_train(args + ["-x", "2", "-h", "1"], cwd=shards).stdout
    assert "HellaSwag: " in out and re.search(r"generating:\n---\n\d+ \d+ \d+ \d+\n---", out)
    formats.write_tokenizer(shards / "gpt2_tokenizer.bin", [b"<%d>" % i for i in range(1000)], 7)
    out = run_train(args + ["-x", "2"], cwd=shards).stdout
    assert re.search(r"generating:\n---\n(<\d+>){4}\n---", out)


# ------------------------------------------------------------------------------------------- the output dir

def start_long_run(shards, out, extra=(), launcher=(), steps=100000):
    """A run that would go on for a long time, started once its first step line is out."""
    log = open(shards / f"{out}.stdout", "w")
    proc = subprocess.Popen([*launcher, sys.executable, TRAIN, *TINY, *data_args(), "-x", str(steps),
                             "-o", out, *extra], cwd=shards, env={**env(), "PYTHONUNBUFFERED": "1"},
                            stdout=log, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and "step    2/" not in open(log.name).read():
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()
    return proc


def test_a_second_run_into_a_directory_in_use_refuses(shards):
    """Two runs writing one -o once made a DONE checkpoint of one run's model and the other's state."""
    first = start_long_run(shards, "ck", ["-n", "1"])
    try:
        proc = run_train(TINY + data_args() + ["-x", "2", "-n", "1", "-o", "ck", "-y", "1"], cwd=shards,
                         check=False)
        assert_one_line_error(proc, f"-o ck: the run of pid {first.pid} on ")
        assert "is writing there: wait for it to end, or use another -o" in proc.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the lock goes with its process, even one killed with -9: now -y 1 resumes
    last = checkpoint.latest_step(shards / "ck")
    assert f"resuming from checkpoint at step {last}" in run_train(
        TINY + data_args() + ["-x", str(last + 1), "-o", "ck", "-y", "1"], cwd=shards).stdout


def test_a_fresh_run_refuses_a_directory_with_checkpoints_and_deletes_nothing(shards):
    run_train(TINY + data_args() + ["-x", "2", "-n", "1", "-o", "ck"], cwd=shards)
    before = sorted(os.listdir(shards / "ck"))
    log = (shards / "ck" / "main.log").read_text()
    proc = run_train(TINY + data_args() + ["-x", "2", "-o", "ck"], cwd=shards, check=False)
    assert_one_line_error(proc, "error: -o ck holds checkpoints of an earlier run (the newest at step 2): "
                                "use -y 1 to resume, or another -o")
    assert sorted(os.listdir(shards / "ck")) == before and (shards / "ck" / "main.log").read_text() == log


def test_temporary_files_of_killed_writes_are_removed_at_start(shards):
    os.makedirs(shards / "ck")
    for name in ("model_00000003.bin.4242.tmp", "DONE_00000003.17.tmp", "notes.tmp"):
        (shards / "ck" / name).write_bytes(b"half")
    run_train(TINY + data_args() + ["-x", "1", "-o", "ck", "-y", "1"], cwd=shards)
    assert sorted(os.listdir(shards / "ck")) == ["LOCK", "main.log", "notes.tmp"]   # only ours go


def test_a_users_file_that_looks_temporary_is_kept(shards):
    """Cleanup once removed every NAME.<digits>.tmp in -o: a user's files too."""
    os.makedirs(shards / "ck")
    for name in ("notes.123.tmp", "model_00000003.bin.draft.7.tmp", "model_3.bin.42.tmp",
                 "state_00000003.bin.9.tmp"):   # the last one is a name this program gives: removed
        (shards / "ck" / name).write_bytes(b"mine")
    run_train(TINY + data_args() + ["-x", "1", "-o", "ck", "-y", "1"], cwd=shards)
    assert sorted(os.listdir(shards / "ck")) == ["LOCK", "main.log", "model_00000003.bin.draft.7.tmp",
                                                 "model_3.bin.42.tmp", "notes.123.tmp"]


def test_a_fresh_run_refuses_a_directory_with_an_earlier_runs_log_and_keeps_it(shards):
    """A run with -o and no checkpoints leaves only main.log: a fresh run there once truncated it."""
    run_train(TINY + data_args() + ["-x", "2", "-o", "out"], cwd=shards)
    log = (shards / "out" / "main.log").read_text()
    proc = run_train(TINY + data_args() + ["-x", "2", "-o", "out"], cwd=shards, check=False)
    assert_one_line_error(proc, "error: -o out holds the main.log of an earlier run: use -y 1 to go on with "
                                "it (its lines are kept), or another -o")
    assert (shards / "out" / "main.log").read_text() == log and log.count("s:2 tel:") == 1
    run_train(TINY + data_args() + ["-x", "2", "-o", "out", "-y", "1"], cwd=shards)
    assert (shards / "out" / "main.log").read_text().startswith(log)


def test_a_run_whose_lock_is_deleted_stops_before_it_writes_again(shards):
    """Once LOCK was deleted, a second run took a new one and both wrote checkpoints into one directory:
    a model of one run got paired with the state of the other."""
    first = start_long_run(shards, "ck", ["-n", "1"])
    try:
        os.remove(shards / "ck" / "LOCK")
        _, stderr = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 1 and "Traceback" not in stderr
    assert re.fullmatch(r"error: -o ck: ck/LOCK was deleted while this run held it, so another run may "
                        r"write there: stopping before writing more; the checkpoint at step \d+ is intact: "
                        r"-y 1 resumes it", stderr.strip()), stderr
    step = checkpoint.latest_step(shards / "ck")
    out = run_train(TINY + data_args() + ["-x", str(step + 1), "-o", "ck", "-y", "1"], cwd=shards).stdout
    assert f"resuming from checkpoint at step {step}" in out and "WARNING" not in out


def limit_file_size(nbytes):
    def preexec():
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))   # Python ignores SIGXFSZ: EFBIG
    return preexec


@pytest.mark.parametrize("fault", ["a file size limit", "a directory where the model file goes"])
def test_a_checkpoint_that_cannot_be_written_stops_with_one_line_and_the_last_one_stays(shards, fault):
    run_train(TINY + data_args() + ["-x", "2", "-n", "2", "-o", "ck"], cwd=shards)
    args = TINY + data_args() + ["-x", "4", "-n", "2", "-o", "ck", "-y", "1"]
    if fault == "a file size limit":   # the model file (13.5 MB) fits under it, the state file (27 MB) not
        preexec, problem, left = limit_file_size(20 << 20), "(File too large)", []
    else:
        os.makedirs(shards / "ck" / "model_00000004.bin")
        preexec, problem, left = None, "Is a directory", ["model_00000004.bin"]
    proc = subprocess.run([sys.executable, TRAIN, *args], cwd=shards, env=env(), capture_output=True,
                          text=True, timeout=300, preexec_fn=preexec)
    assert_one_line_error(proc, "error: cannot write the checkpoint at step 4 in ck (")
    assert problem in proc.stderr and "; the checkpoint at step 2 is intact: -y 1 resumes it" in proc.stderr
    assert sorted(os.listdir(shards / "ck")) == sorted(["DONE_00000002", "LOCK", "main.log",
                                                        "model_00000002.bin", "state_00000002.bin"] + left)
    if left:
        os.rmdir(shards / "ck" / left[0])
    assert "resuming from checkpoint at step 2" in run_train(args, cwd=shards).stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_under_the_log_stops_with_one_line(shards):
    os.makedirs(shards / "out")
    os.symlink("/dev/full", shards / "out" / "main.log")   # every write there fails with ENOSPC
    proc = run_train(TINY + data_args() + ["-x", "2", "-o", "out"], cwd=shards, check=False)
    assert_one_line_error(proc, f"error: cannot write {os.path.join('out', 'main.log')} (No space left on "
                                f"device)")


# ---------------------------------------------------------------------------------------------- changing data

@pytest.mark.parametrize("change", ["renamed over", "truncated in place"])
def test_a_shard_that_changes_under_a_run_is_read_as_validated_or_stops_it_with_one_line(shards, change):
    """Re-prepared under its name, a shard once gave a traceback at the next epoch; truncated in place,
    a SIGBUS and no message. A shard of 8192 tokens is 64 steps of -b 4 -t 32: epoch 1 starts at step 65."""
    proc = start_long_run(shards, "out")
    if change == "renamed over":
        formats.write_shard(shards / "data" / "train.bin", np.full(2000, 7))   # 62 samples, not 255
    else:
        os.truncate(shards / "data" / "train.bin", 1024 + 2 * 100)
    try:
        if change == "renamed over":
            deadline = time.time() + 240
            while time.time() < deadline and proc.poll() is None and \
                    "step   70/" not in (shards / "out.stdout").read_text():
                time.sleep(0.2)
            assert proc.poll() is None, proc.stderr.read()   # still training, in its second epoch
            return
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1 and "Traceback" not in stderr
    assert stderr.strip() == ("error: data/train.bin: changed while this run reads it (truncated or written "
                              "in place since start-up): restore it, or write new shards aside and rename "
                              "them over (as data/*.py do), then -y 1 resumes from the last checkpoint"), \
        stderr


def test_train_data_that_holds_the_val_shard_gets_a_warning(shards):
    warning = ("WARNING: the train data (-i) and the val data (-j) share 1 file(s), data/val.bin: the val "
               "loss is measured on data the model trains on")
    out = run_train(TINY + ["-i", "data/*.bin", "-j", "data/val.bin", "-x", "1"], cwd=shards).stdout
    assert warning in out.splitlines()
    out = run_train(TINY + ["-i", "data/val.bin", "-j", "data/val.bin", "-x", "1"], cwd=shards).stdout
    assert warning in out.splitlines()
    assert "WARNING" not in run_train(TINY + data_args() + ["-x", "1"], cwd=shards).stdout
    overfit = run_train(TINY + data_args() + ["-x", "1", "-a", "1"], cwd=shards).stdout   # trains on -j
    assert "WARNING" not in overfit


# ---------------------------------------------------------------------------------------------- resume

def test_a_checkpoint_past_the_last_step_is_refused(shards):
    """A checkpoint at step 2 and -x 1: the run once did nothing at all and exited 0."""
    run_train(TINY + data_args() + ["-x", "2", "-n", "2", "-o", "ck"], cwd=shards)
    proc = run_train(TINY + data_args() + ["-x", "1", "-o", "ck", "-y", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, "error: -o ck: its newest checkpoint is at step 2, past this run's last "
                                "step 1: raise -x to train on")


def flip_bits(path, byte_offsets):
    with open(path, "r+b") as f:
        for offset in byte_offsets:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ 0x01]))


def zero_payload(path):
    with open(path, "r+b") as f:
        f.seek(1024)
        f.write(bytes(os.path.getsize(path) - 1024))


def move_data_position(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    with open(path, "r+b") as f:
        f.seek(4 * 32)
        f.write(np.int32(header[32] + 4).tobytes())


M = os.path.join("ck", "model_00000004.bin")
S = os.path.join("ck", "state_00000004.bin")


@pytest.mark.parametrize("damage, problem", [
    pytest.param(lambda ck: flip_bits(ck / "state_00000004.bin", 1024 + 4 * np.arange(1000)),
                 f"{S}: its bytes do not match the checksum it records", id="1,000 flipped words in m"),
    pytest.param(lambda ck: flip_bits(ck / "model_00000004.bin", [1024 + 5, 1024 + 4 * 10**6 + 1]),
                 f"{M}: its bytes do not match the checksum it records", id="flipped bits in the model"),
    pytest.param(lambda ck: shutil.copyfile(ck / "model_00000002.bin", ck / "model_00000004.bin"),
                 f"{M}: not the model file saved with {S}", id="a model file of another step"),
    pytest.param(lambda ck: move_data_position(ck / "state_00000004.bin"),
                 f"{S}: its bytes do not match the checksum", id="a moved data position"),
    pytest.param(lambda ck: zero_payload(ck / "model_00000004.bin"),
                 f"{M}: its bytes do not match the checksum", id="a model of zeros"),
])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one_and_resumes_bit_for_bit(shards, damage,
                                                                                             problem):
    """Each of these was once resumed as if nothing were wrong (a model of zeros: grad norm 0 forever)."""
    full = step_losses(run_train(TINY + data_args() + ["-x", "6"], cwd=shards).stdout)
    args = TINY + data_args() + ["-x", "6", "-n", "2", "-o", "ck"]
    run_train(args, cwd=shards)
    checkpoint.delete(shards / "ck", 6)   # as if the run had died after step 4's checkpoint
    damage(shards / "ck")
    out = run_train(args + ["-y", "1"], cwd=shards).stdout
    warning = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warning) == 1 and warning[0].startswith(
        f"WARNING: skipping the damaged checkpoint at step 4, resuming from step 2: {problem}"), out
    assert "resuming from checkpoint at step 2" in out and step_losses(out) == full[2:]
    for step in (2, 4, 6):   # the run wrote 4 anew over the damaged files, and 6: all intact, each a pair
        formats.read_model(checkpoint.model_path(shards / "ck", step))
        state = formats.read_state(checkpoint.state_path(shards / "ck", step), P)
        assert state["model_checksum"] == formats.model_checksum(checkpoint.model_path(shards / "ck", step))


def test_when_every_checkpoint_is_damaged_the_newest_ones_problem_is_the_line(shards):
    run_train(TINY + data_args() + ["-x", "4", "-n", "2", "-o", "ck"], cwd=shards)
    for step in (2, 4):
        zero_payload(shards / "ck" / f"model_{step:08d}.bin")
    proc = run_train(TINY + data_args() + ["-x", "6", "-o", "ck", "-y", "1"], cwd=shards, check=False)
    assert_one_line_error(proc, f"error: {M}: its bytes do not match the checksum it records")
    assert proc.stderr.strip().endswith("the file is damaged; the 1 earlier checkpoint(s) are damaged too: "
                                        "no checkpoint here can be resumed; restore the files, or train anew "
                                        "with another -o")


def test_resume_with_another_seq_len_or_train_data_is_refused(shards):
    """The saved position counts samples of T+1 tokens of one train set: elsewhere it would skip or repeat
    data."""
    run_train(TINY + data_args() + ["-x", "2", "-n", "2", "-o", "ck"], cwd=shards)
    state = os.path.join("ck", "state_00000002.bin")
    proc = run_train(TINY[:4] + ["-t", "16"] + TINY[6:] + data_args() + ["-x", "4", "-o", "ck", "-y", "1"],
                     cwd=shards, check=False)
    assert_one_line_error(proc, f"error: {state}: written with -t 32, and this run has -t 16")
    formats.write_shard(shards / "data" / "more.bin", np.zeros(4 * 1024 + 1, np.int64))
    proc = run_train(TINY + ["-i", "data/*.bin", "-j", "data/val.bin", "-x", "4", "-o", "ck", "-y", "1"],
                     cwd=shards, check=False)
    assert_one_line_error(proc, f"error: {state}: written over train data of 256 samples per epoch, and "
                                f"'data/*.bin' has 448")


def test_resume_restores_the_outlier_windows_exactly(shards):
    """The -sl/-sg windows fill at step 129; a run resumed at 130 must print the same z-scores and skip the
    same updates as the run that went on (once it restarted with empty windows and differed by 6.5e-3)."""
    args = ["-e", "d1c16h4", "-b", "1", "-t", "8"] + TINY[6:] + data_args() + ["-x", "136", "-sl", "0.1",
                                                                             "-o", "ck"]
    full = run_train(args + ["-n", "130"], cwd=shards).stdout
    checkpoint.delete(shards / "ck", 136)
    resumed = run_train(args + ["-y", "1"], cwd=shards).stdout
    pattern = re.compile(r"^step +\d+/136 \| loss (\S+) \((\S+)z\)\| norm (\S+) \((\S+)z\)", re.M)
    assert "skipping update due to loss z-score" in full.split("step  130/136")[1]
    assert len(pattern.findall(resumed)) == 6 and pattern.findall(resumed) == pattern.findall(full)[-6:]


# ---------------------------------------------------------------------------------------------- divergence

def test_a_diverged_run_stops_after_max_nonfinite_steps_in_a_row(shards):
    """-l 1e30: the first update sends the parameters to 1e30, every loss after it is NaN. The run once
    went on skipping to its last step and exited 0."""
    args = TINY[:6] + ["-l", "1e30"] + TINY[8:] + data_args()
    proc = run_train(args + ["-x", "50"], cwd=shards, check=False)   # --max-nonfinite 5
    assert_one_line_error(proc, "error: stopping: 5 steps in a row had a non-finite loss or grad norm")
    assert proc.stdout.count("skipping update: non-finite") == 4 and "step    6/50" not in proc.stdout
    proc = run_train(args + ["-x", "8", "--max-nonfinite", "0"], cwd=shards, check=False)   # 0: never stop
    assert proc.stdout.count("skipping update: non-finite") == 7
    # but the run ends diverged, and says so
    assert_one_line_error(proc, "error: the run ended with a non-finite loss (val nan, train nan)")


def test_a_run_that_ends_with_a_non_finite_loss_exits_non_zero(shards):
    """Diverged in fewer steps than --max-nonfinite: the run once went on to its end and exited 0."""
    args = TINY[:6] + ["-l", "1e30"] + TINY[8:] + data_args() + ["-x", "3"]
    proc = run_train(args, cwd=shards, check=False)
    assert proc.stdout.count("skipping update: non-finite") == 2 and "step    3/3" in proc.stdout
    assert_one_line_error(proc, "error: the run ended with a non-finite loss (val nan, train nan): it "
                                "diverged; lower -l, or resume from an earlier checkpoint")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("z_scores", [False, True])
def test_non_finite_loss_never_reaches_the_weights(z_scores):
    """Without -sl/-sg the update is queued before the host reads the loss, and skips itself (a NaN
    clipping factor); with them the host decides first."""
    from llm.backends import get_backend
    from llm.comm import SingleComm
    from llm.layout import ParamViews
    from llm.model import GPT2
    from llm.outliers import UpdateGuard
    from llm.step import train_step
    from llm.zero import ZeroOptimizer
    config = GPT2Config.from_descriptor("d2c64h4")
    params = init_params(config)
    ParamViews(params, config).lnfb[0] = np.inf           # every logit, and so every loss, becomes nan
    model = GPT2(config, get_backend("numpy"))
    model.load_params(params)
    optimizer = ZeroOptimizer(model, SingleComm(), 0, 0.0)
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 9)).astype(np.int32)
    guard = UpdateGuard(loss_threshold=3.0) if z_scores else UpdateGuard()
    assert guard.uses_z_scores == z_scores
    result = train_step(model, optimizer, [(tokens[:, :-1], tokens[:, 1:])], 1e-3, 1, guard)
    assert result.skipped.startswith("skipping update: non-finite loss nan")
    np.testing.assert_array_equal(model.params_numpy(), params)   # untouched, inf included


# ---------------------------------------------------------------------------------------------- signals

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_a_single_process_with_one_line(shards, sig):
    proc = start_long_run(shards, "out")
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert stderr.strip() == f"stopped by {sig.name}"


def test_sigusr1_writes_a_checkpoint_that_resumes_bit_for_bit(shards):
    """Slurm's warning before it pre-empts a job (srun --signal=USR1@90): the step ends, a checkpoint is
    written, and -y 1 goes on with the losses of the run that was never stopped."""
    full = step_losses(run_train(TINY + data_args() + ["-x", "20"], cwd=shards).stdout)
    proc = start_long_run(shards, "ck", steps=20)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=60)
    stopped = re.fullmatch(r"stopped by SIGUSR1 at step (\d+): its checkpoint is in ck, -y 1 resumes it\n",
                           stderr)
    assert proc.returncode == 128 + signal.SIGUSR1 and stopped, (proc.returncode, stderr)
    step = int(stopped.group(1))
    assert 2 <= step < 20 and checkpoint.latest_step(shards / "ck") == step
    resumed = run_train(TINY + data_args() + ["-x", "20", "-o", "ck", "-y", "1"], cwd=shards).stdout
    assert f"resuming from checkpoint at step {step}" in resumed
    assert len(full) == 20 and step_losses(resumed) == full[step:]


def test_sigusr1_without_an_output_dir_says_there_is_nothing_to_save(shards):
    proc = subprocess.Popen([sys.executable, TRAIN, *TINY, *data_args(), "-x", "100000"], cwd=shards,
                            env={**env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while (line := proc.stdout.readline()) and not line.startswith("step    1/"):
        pass
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1
    assert stderr == "stopped by SIGUSR1: without -o there is nothing to save\n"


@needs_mpiexec
def test_sigusr1_to_one_rank_under_mpiexec_checkpoints_and_stops_every_rank(shards):
    """The ranks agree at each step whether any of them got the signal: all write the checkpoint, all stop."""
    proc = start_long_run(shards, "sig", ["-z", "1"], launcher=mpirun(2))
    os.kill(rank_pids("sig", 1)[0], signal.SIGUSR1)
    code, stderr, _ = wait_for_the_end(proc, "sig", timeout=60)
    stopped = re.fullmatch(r"rank 0: stopped by SIGUSR1 at step (\d+): its checkpoint is in sig, -y 1 "
                           r"resumes it", stderr.strip())
    assert code != 0 and stopped, (code, stderr)
    assert checkpoint.latest_step(shards / "sig") == int(stopped.group(1))


def wait_for_the_end(proc, marker, timeout=30):
    """Wait for an mpiexec job; -> (returncode, stderr, seconds). Fails if any rank of it is left running."""
    t0 = time.time()
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the job still ran {timeout} s later")
    seconds = time.time() - t0
    while (rank_pids(marker, 0) or rank_pids(marker, 1)) and time.time() - t0 < timeout:
        time.sleep(0.1)   # the launcher may return while a killed rank is still being torn down
    assert not rank_pids(marker, 0) and not rank_pids(marker, 1), f"a rank is still running:\n{stderr}"
    return proc.returncode, stderr, seconds


@needs_mpiexec
@pytest.mark.parametrize("sig, target", [(signal.SIGINT, "every process"),   # Ctrl-C in a terminal
                                         (signal.SIGTERM, "mpiexec"),        # a scheduler ending the job
                                         (signal.SIGINT, "rank 1")])
def test_a_signal_under_mpiexec_stops_every_rank_with_one_line(shards, sig, target):
    """Ctrl-C once left rank 0 with a KeyboardInterrupt traceback and rank 1 spinning in a collective."""
    proc = start_long_run(shards, "sig", ["-z", "1"], launcher=mpirun(2))
    if target == "every process":
        os.killpg(proc.pid, sig)
    elif target == "mpiexec":
        proc.send_signal(sig)
    else:
        os.kill(rank_pids("sig", 1)[0], sig)
    code, stderr, seconds = wait_for_the_end(proc, "sig")
    assert code != 0 and seconds < 10, (code, seconds, stderr)
    assert re.fullmatch(rf"rank \d: stopped by {sig.name}", stderr.strip()), stderr   # once MPICH's too


@needs_mpiexec
def test_a_second_ctrl_c_under_mpiexec_still_ends_every_rank_with_a_non_zero_code(shards):
    """mpiexec takes a second Ctrl-C as 'abort now' and ends the ranks itself, with lines of its own (once
    that ended the job with exit code 0). The two come 0.3 s apart, a quick double tap: within 0.1 s of the
    first, MPICH's mpiexec itself exits with 0 about one time in six, whatever the ranks do."""
    proc = start_long_run(shards, "sig", ["-z", "1"], launcher=mpirun(2))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    code, stderr, seconds = wait_for_the_end(proc, "sig")
    assert code != 0 and seconds < 10 and "Traceback" not in stderr, (code, seconds, stderr)


@needs_mpiexec
@pytest.mark.parametrize("args, message", [
    (["-b", "0"],
     "rank 0: error: -b 0: must be positive (micro batch size B per process) (--help lists the flags)"),
    (["-o", "data/train.bin"], "rank 0: error: -o data/train.bin: exists and is not a folder: name a folder"),
])
def test_bad_input_under_mpiexec_is_one_line_and_every_rank_stops(shards, args, message):
    """Every rank sees a bad flag, rank 0 alone a bad -o: either way one line, from rank 0 (once also MPICH's
    'Abort(1) on node 0 ...', and sometimes no line at all: the job ended before the launcher passed it
    on)."""
    proc = run_train(TINY + data_args() + ["-x", "1"] + args, cwd=shards, check=False, launcher=mpirun(2))
    assert proc.returncode == 1 and proc.stderr.strip() == message, proc.stderr


def with_flag(args, flag, value):
    """args with `flag` set to `value`, in its place if it is there."""
    args = list(args)
    if flag in args:
        args[args.index(flag) + 1] = value
        return args
    return args + [flag, value]


AGREE = "every rank must run with the same flags and see the same files"


@needs_mpiexec
@pytest.mark.parametrize("flag, rank0, rank1", [
    ("-b", "4", "2"),              # once: wrong losses, printed as if nothing were amiss
    ("-x", "2", "3"),              # once: rank 0 ended, rank 1 waited for it forever
    ("-e", "d2c64h4", "d2c32h4"),  # once: MPICH's error stack, 12 lines
])
def test_ranks_started_with_different_flags_stop_with_one_line_naming_the_flag(shards, flag, rank0, rank1):
    """An MPMD launch (mpiexec -n 1 A : -n 1 B) gives each rank its own command line."""
    args = TINY + data_args() + ["-x", "2", "-o", "agree"]
    ranks = [[sys.executable, TRAIN, *with_flag(args, flag, value)] for value in (rank0, rank1)]
    proc = subprocess.Popen([MPIEXEC, "-n", "1", *ranks[0], ":", "-n", "1", *ranks[1]], cwd=shards,
                            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    code, stderr, _ = wait_for_the_end(proc, "agree")
    assert code == 1 and stderr.strip() == (f"rank 0: error: ranks disagree on {flag}: {rank0} on rank 0 "
                                            f"but {rank1} on rank 1: {AGREE}"), (code, stderr)


def xxh3(tokens):
    return f"{xxhash.xxh3_64(np.asarray(tokens, '<u2').tobytes()).intdigest():016x}"


@needs_mpiexec
@pytest.mark.parametrize("differs", ["a val shard", "the HellaSwag file"])
def test_ranks_that_see_different_files_stop_with_one_line_naming_the_file(shards, differs):
    """Rank 1 runs where its data/ is another (tests/mpi_elsewhere.py), as on a node of its own: a val
    shard with one token changed, or no HellaSwag file where rank 0 has one (-h 1 then evaluated on rank 0
    alone)."""
    node = shards / "node1"
    os.makedirs(node / "data")
    os.symlink(shards / "data" / "train.bin", node / "data" / "train.bin")
    val = formats.read_shard(shards / "data" / "val.bin").copy()
    if differs == "a val shard":
        other = val.copy()
        other[1000] += 1
        formats.write_shard(node / "data" / "val.bin", other)
        problem = (f"data/val.bin: 2,049 tokens, checksum {xxh3(val)} on rank 0 but 2,049 tokens, "
                   f"checksum {xxh3(other)} on rank 1")
    else:
        os.symlink(shards / "data" / "val.bin", node / "data" / "val.bin")
        os.makedirs(shards / "data" / "hellaswag")
        path = shards / "data" / "hellaswag" / "hellaswag_val.bin"
        formats.write_eval(path, [dict(label=1, context=[1, 2, 3], completions=[[4], [5, 6], [7], [8]])] * 3)
        problem = (f"data/hellaswag/hellaswag_val.bin: 3 examples, {os.path.getsize(path):,} bytes on "
                   f"rank 0 but no such file on rank 1")
    elsewhere_py = os.path.join(REPO, "tests", "mpi_elsewhere.py")
    proc = subprocess.Popen(mpirun(2) + [sys.executable, elsewhere_py, str(node), *TINY, *data_args(),
                                         "-x", "2", "-h", "1"],
                            cwd=shards, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    code, stderr, _ = wait_for_the_end(proc, str(node))
    assert code == 1, (code, stderr)
    assert stderr.strip() == f"rank 0: error: ranks disagree on {problem}: {AGREE}", stderr


@needs_mpiexec
def test_an_unexpected_exception_on_one_rank_prints_its_traceback_and_stops_every_rank(shards):
    proc = subprocess.Popen(mpirun(2) + [sys.executable, os.path.join(REPO, "tests", "mpi_crash.py"), *TINY,
                                         *data_args(), "-x", "100000", "-o", "crash"],
                            cwd=shards, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    code, stderr, _ = wait_for_the_end(proc, "crash", timeout=60)
    assert code != 0
    assert "rank 1: Traceback (most recent call last)" in stderr
    assert "RuntimeError: an unexpected bug on rank 1" in stderr


def test_threads_per_rank_are_the_cores_shared_among_the_local_ranks(monkeypatch):
    from threadpoolctl import threadpool_info, threadpool_limits
    from llm import launch

    def blas_threads():
        return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()   # nothing leaks into later tests
                                        if k not in (*launch.THREAD_VARS, *launch.LOCAL_SIZE_VARS,
                                                     *launch.YIELD_VARS)})
    monkeypatch.setattr(launch, "cores", lambda: 8)
    with threadpool_limits(5):   # BLAS's pools as they were, afterwards
        os.environ["MPI_LOCALNRANKS"] = "3"                       # mpich's hydra
        assert launch.threads_per_rank() == 2
        launch.limit_threads()
        assert blas_threads() == {2}                               # numpy's BLAS, sized after it loaded
        assert not set(launch.YIELD_VARS) & set(os.environ)        # 3 ranks on 8 cores: waiting may spin
        os.environ["OMP_NUM_THREADS"] = "1"                       # what the user sets stays: BLAS read it
        threadpool_limits(5)
        launch.limit_threads()
        assert blas_threads() == {5}
        del os.environ["MPI_LOCALNRANKS"], os.environ["OMP_NUM_THREADS"]
        os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = "16"           # Open MPI, more ranks than cores
        assert launch.threads_per_rank() == 1
        launch.limit_threads()
        assert blas_threads() == {1}
        assert all(os.environ[name] == value for name, value in launch.YIELD_VARS.items())
        del os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]
        os.environ["MPI_LOCALNRANKS"] = "0"   # no launcher's: a size of 0, left behind, is passed over
        assert launch.local_ranks() == launch.launched_world_size() == 1 and launch.threads_per_rank() == 8


@needs_mpiexec
def test_ranks_on_few_cores_share_them_instead_of_oversubscribing(shards):
    """Four ranks once each started a BLAS thread and a pool thread per core: on 2 cores, a step of -np 4
    burned 20 to 40 times the CPU time of -np 1. Sized per local rank, they cost 1.4 to 2.8 times as much
    (four ranks pass messages and take turns on the cores), so the bound is 5. Steps are counted as the
    difference of a 22-step and a 2-step run, so that starting four interpreters (which alone costs up to
    4 times one) does not count."""
    def cpu_seconds(n, steps):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        run_train(TINY[:2] + ["-b", str(4 // n)] + TINY[4:] + data_args() + ["-d", "128", "-x", str(steps),
                                                                           "-z", "1"],
                  cwd=shards, launcher=mpirun(n) if n > 1 else ())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)   # the ranks are mpiexec's children's children
        return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    one, four = (cpu_seconds(n, 22) - cpu_seconds(n, 2) for n in (1, 4))
    assert four < 5 * one, (one, four)
