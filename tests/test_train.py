"""train_gpt2.py end to end on the CPU: printed lines, the log, checkpoints, resume (bad input and faults:
test_faults.py)."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

from llm import checkpoint, formats
from conftest import STEP_LINE, TINY, TRAIN, clone_trainer, data_args, env, run_train, step_losses


def test_step_lines_and_log_follow_llmc_formats(shards):
    out = run_train(TINY + data_args() + ["-x", "4", "-v", "2", "-o", "out"], cwd=shards).stdout
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all(STEP_LINE.match(line) for line in steps), steps
    assert steps[0].startswith("step    1/4 | loss ") and "(z n/a)| norm " in steps[0]
    assert "| fp32 MFU n/a |" in steps[0]   # the CPU's peak FLOP/s is not known
    assert re.search(r"^val loss \d+\.\d{6}$", out, re.M)
    assert re.search(r"^\| Zero Optimization is disabled +\|$", out, re.M)
    assert re.search(r"^allocated \d+ MiB for AdamW optimizer state m$", out, re.M)
    log = open(shards / "out" / "main.log").read().splitlines()
    val_loss = float(re.search(r"val loss (\S+)", out).group(1))
    assert log[0] == f"s:0 tel:{val_loss:.4f}"
    train_lines = [line for line in log if "trl" in line]
    assert [line.split()[0] for line in train_lines] == ["s:0", "s:1", "s:2", "s:3"]
    assert all(re.fullmatch(r"s:\d+ trl:\d+\.\d{4} lr:\d+\.\d{6} norm:\d+\.\d\d", line)
               for line in train_lines)
    assert [line for line in log if "tel" in line][-1].startswith("s:4 tel:")   # val at the last step too


def test_resumed_run_prints_the_same_losses_bit_for_bit(shards):
    full = step_losses(run_train(TINY + data_args() + ["-x", "6"], cwd=shards).stdout)
    run_train(TINY + data_args() + ["-x", "6", "-n", "3", "-o", "ck"], cwd=shards)
    checkpoint.delete(shards / "ck", 6)                 # as if the run had died after step 3's checkpoint
    resumed = run_train(TINY + data_args() + ["-x", "6", "-n", "3", "-o", "ck", "-y", "1"], cwd=shards).stdout
    assert "resuming from checkpoint at step 3" in resumed
    assert len(full) == 6 and step_losses(resumed) == full[3:]


def test_a_resumed_run_leaves_the_main_log_of_the_run_that_was_not_interrupted(shards):
    """A resume measures the val loss of its checkpoint's step again, and after a crash redoes the steps
    since that checkpoint: main.log keeps one line of each kind a step, as if nothing had stopped."""
    args = TINY + data_args() + ["-x", "6", "-v", "2", "-n", "2", "-o", "ck"]
    run_train(args, cwd=shards)
    full = (shards / "ck" / "main.log").read_text()
    assert full.count("s:2 tel:") == 1 and len(full.splitlines()) == 6 + 4   # 6 train lines, val at 0 2 4 6
    for step in (4, 6):
        checkpoint.delete(shards / "ck", step)   # as if it died after logging step 6, before its checkpoints
    assert "resuming from checkpoint at step 2" in run_train(args + ["-y", "1"], cwd=shards).stdout
    assert (shards / "ck" / "main.log").read_text() == full


def test_a_main_log_with_bytes_that_are_not_text_does_not_stop_a_resume(shards):
    args = TINY + data_args() + ["-v", "2", "-n", "2", "-o", "ck"]
    run_train(args + ["-x", "2"], cwd=shards)
    with open(shards / "ck" / "main.log", "ab") as f:
        f.write(b"\xff\xfe\n")
    assert "resuming from checkpoint at step 2" in run_train(args + ["-x", "4", "-y", "1"], cwd=shards).stdout
    after = (shards / "ck" / "main.log").read_bytes().split(b"\xff\xfe\n")[1].decode()
    assert [checkpoint.log_key(line) for line in after.splitlines()] == [("s:2", "trl"), ("s:3", "trl"),
                                                                         ("s:4", "tel")]


def test_killed_run_never_leaves_a_checkpoint_that_fails_to_load(shards):
    """Kill the trainer at several moments, mid-write included; every DONE checkpoint must load and resume."""
    args = TINY + data_args() + ["-x", "12", "-n", "1", "-o", "ck", "-y", "1"]
    reference = step_losses(run_train(TINY + data_args() + ["-x", "12"], cwd=shards).stdout)
    for round_, delay in enumerate((0.0, 0.002, 0.005)):
        proc = subprocess.Popen([sys.executable, TRAIN, *args], cwd=shards, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:   # kill while a later checkpoint is written
            names = os.listdir(shards / "ck") if os.path.isdir(shards / "ck") else []
            writing = any(n.endswith(".tmp") for n in names)
            if (checkpoint.latest_step(shards / "ck") or 0) >= 3 * round_ and writing:
                time.sleep(delay)
                break
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        step = checkpoint.latest_step(shards / "ck")
        if step is not None:   # what -y 1 would take must load
            config, _, _ = formats.read_model(checkpoint.model_path(shards / "ck", step))
            formats.read_state(checkpoint.state_path(shards / "ck", step), config.num_parameters)
    resumed = run_train(args, cwd=shards).stdout
    start = int(re.search(r"resuming from checkpoint at step (\d+)", resumed).group(1))
    assert 0 < start < 12
    assert step_losses(resumed) == reference[start:]


def test_loss_falls_when_overfitting_one_batch(shards):
    out = run_train(TINY + data_args() + ["-x", "20", "-a", "1", "-l", "3e-3"], cwd=shards).stdout
    losses = [float(x) for x in step_losses(out)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_token_id_out_of_range_names_the_shard(shards):
    tokens = np.zeros(4097, dtype=np.int64)
    tokens[100] = 50300
    formats.write_shard(shards / "data" / "bad.bin", tokens)
    proc = run_train(TINY + ["-i", "data/bad.bin", "-j", "data/val.bin", "-x", "1"], cwd=shards, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "data/bad.bin: token id 50300 at position 100 is >= vocab size 50257" in proc.stderr


def test_resume_with_a_different_model_is_refused(shards):
    run_train(TINY + data_args() + ["-x", "2", "-n", "1", "-o", "ck"], cwd=shards)
    proc = run_train(["-e", "d2c32h4"] + TINY[2:] + data_args() + ["-x", "4", "-o", "ck", "-y", "1"],
                     cwd=shards, check=False)
    assert proc.returncode == 1 and proc.stderr == (
        "error: ck/model_00000002.bin: holds a d2c64h4 (V 50257 padded to 50304, maxT 1024) model, but -e "
        "gives d2c32h4 (V 50257 padded to 50304, maxT 1024): resume with the -e the run was started with\n")


def test_keep_only_the_newest_checkpoints(shards):
    run_train(TINY + data_args() + ["-x", "5", "-n", "1", "-nk", "2", "-o", "ck"], cwd=shards)
    assert sorted(f for f in os.listdir(shards / "ck") if f.startswith("DONE")) == ["DONE_00000004",
                                                                                    "DONE_00000005"]
    assert sorted(f for f in os.listdir(shards / "ck") if f.startswith("model")) == \
        ["model_00000004.bin", "model_00000005.bin"]


def done_steps(directory):
    return sorted(int(f[5:]) for f in os.listdir(directory) if f.startswith("DONE_"))


def test_keep_exactly_k_checkpoints_off_the_n_grid_and_across_a_resume(shards):
    """-nk deleted only the checkpoint K*n steps back: the last step (off the -n grid) and a resume with
    another -n left more than K."""
    run_train(TINY + data_args() + ["-x", "5", "-n", "2", "-nk", "1", "-o", "a"], cwd=shards)
    assert done_steps(shards / "a") == [5]
    assert sorted(f for f in os.listdir(shards / "a") if f.endswith(".bin")) == ["model_00000005.bin",
                                                                                 "state_00000005.bin"]
    run_train(TINY + data_args() + ["-x", "4", "-n", "1", "-o", "b"], cwd=shards)
    run_train(TINY + data_args() + ["-x", "9", "-n", "2", "-nk", "2", "-o", "b", "-y", "1"], cwd=shards)
    assert done_steps(shards / "b") == [8, 9]
    run_train(TINY + data_args() + ["-x", "12", "-n", "1", "-nk", "2", "-nm", "10", "-o", "b", "-y", "1"],
              cwd=shards)
    assert done_steps(shards / "b") == [10, 11, 12]   # 10 is a multiple of -nm: never deleted


def test_plot_renders_main_log_to_a_png(shards):
    run_train(TINY + data_args() + ["-x", "3", "-v", "1", "-o", "out"], cwd=shards)
    proc = subprocess.run([sys.executable, "-m", "llm.plot", "out"], cwd=shards, env=env(),
                          capture_output=True, text=True, check=True)
    assert "3 train and 4 val points" in proc.stdout
    png = open(shards / "out" / "loss.png", "rb").read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"


def test_hellaswag_eval_runs_when_its_file_exists(shards):
    rng = np.random.default_rng(1)
    examples = [dict(label=int(rng.integers(4)), context=list(rng.integers(0, 50257, 5)),
                     completions=[list(rng.integers(0, 50257, 3)) for _ in range(4)]) for _ in range(3)]
    os.makedirs(shards / "data" / "hellaswag")
    formats.write_eval(shards / "data" / "hellaswag" / "hellaswag_val.bin", examples)
    out = run_train(TINY + data_args() + ["-x", "2", "-v", "1", "-h", "1", "-o", "out"], cwd=shards).stdout
    assert "| run hellaswag         | yes" in out
    assert len(re.findall(r"^HellaSwag: \d/3 = \d\.\d{6}$", out, re.M)) == 2      # at steps 1 and 2
    assert re.search(r"^s:2 eval:\d\.\d{4}$", open(shards / "out" / "main.log").read(), re.M)


def test_hellaswag_flag_without_its_file_says_so(shards):
    train = clone_trainer(shards / "clone")   # a repository without data/hellaswag
    out = run_train(TINY + data_args() + ["-x", "1", "-h", "1"], cwd=shards, train=train).stdout
    assert "| run hellaswag         | no" in out and "python -m data.hellaswag" in out


def test_grad_norm_outliers_are_skipped_once_the_window_fills(shards):
    out = run_train(TINY + data_args() + ["-x", "135", "-sg", "1e-6", "-v", "1000"], cwd=shards).stdout
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert all(line.count("(z n/a)") == 2 for line in lines[:128]) and "n/a)" not in lines[128]
    assert "skipping update due to grad z-score of" in out
    # the window fills at step 129: no step before it is skipped (a skip is reported before its step line)
    assert "skipping update" not in out.split(lines[127])[0]
    assert 1 <= out.count("skipping update due to grad z-score") <= 135 - 128


def test_gradient_accumulation_equals_one_big_batch(shards):
    big = step_losses(run_train(TINY[:2] + ["-b", "6"] + TINY[4:] + data_args() + ["-x", "4"],
                                cwd=shards).stdout)
    accumulated = run_train(TINY[:2] + ["-b", "2"] + TINY[4:] + data_args() + ["-x", "4", "-d", str(6 * 32)],
                            cwd=shards).stdout
    assert "=> setting grad_accum_steps=3" in accumulated
    np.testing.assert_allclose([float(x) for x in step_losses(accumulated)], [float(x) for x in big],
                               rtol=1e-5)
