"""What a newcomer sees when something is missing: one line naming the file and the command that makes it,
and a step line that says "n/a" where a value is not known yet."""
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from llm import formats
from llm.config import GPT2Config
from llm.data import DataError, DataLoader
from llm.report import Throughput, duration, step_line
from llm.weight_init import init_params
from conftest import REPO, TINY, clone_trainer, data_args, env, run_train


def one_line_error(proc):
    """The process failed with exit status 1 and printed one line, "error: ...", and no traceback: that
    line."""
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_missing_default_data_says_run_make_data_and_where_it_looked(tmp_path):
    train = clone_trainer(tmp_path / "clone")
    line = one_line_error(run_train(TINY + ["-x", "1"], cwd=tmp_path, check=False, train=train))
    assert (f"no files match -i/-j pattern 'data/tinyshakespeare/tiny_shakespeare_train.bin' in {tmp_path}: "
            "run `make data` (or python -m data.tinyshakespeare) to write them") in line


def test_a_run_started_elsewhere_finds_the_default_files_where_the_data_scripts_write_them(tmp_path):
    """The data scripts write into the repository, wherever they run from: a run started in another
    directory takes the default data, model, tokenizer and HellaSwag file from there."""
    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    train = clone_trainer(clone)
    os.makedirs(clone / "data" / "tinyshakespeare")
    rng = np.random.default_rng(0)
    for split, n in (("train", 8 * 1024 + 1), ("val", 2 * 1024 + 1)):
        formats.write_shard(clone / "data" / "tinyshakespeare" / f"tiny_shakespeare_{split}.bin",
                            rng.integers(0, 50257, n))
    config = GPT2Config.from_descriptor("d2c64h4")
    formats.write_model(clone / "gpt2_124M_bf16.bin", config, init_params(config), version=3)
    formats.write_tokenizer(clone / "gpt2_tokenizer.bin", [b"<%d>" % i for i in range(50257)], 50256)
    examples = [dict(label=int(rng.integers(4)), context=list(rng.integers(0, 50257, 5)),
                     completions=[list(rng.integers(0, 50257, 3)) for _ in range(4)]) for _ in range(3)]
    os.makedirs(clone / "data" / "hellaswag")
    formats.write_eval(clone / "data" / "hellaswag" / "hellaswag_val.bin", examples)
    os.makedirs(elsewhere)
    out = run_train(["-b", "4", "-t", "32", "-x", "1", "-v", "1", "-m", "1", "-s", "1", "-g", "3", "-h", "1"],
                    cwd=elsewhere, train=train).stdout
    data = clone / "data" / "tinyshakespeare"
    assert f"| train data pattern    | {data / 'tiny_shakespeare_train.bin'}" in out
    assert f"| val data pattern      | {data / 'tiny_shakespeare_val.bin'}" in out
    assert f"| weight init method    | {clone / 'gpt2_124M_bf16.bin'}" in out
    assert "| run hellaswag         | yes" in out and "HellaSwag: " in out
    assert re.search(r"generating:\n---\n(<\d+>)+\n---", out)   # decoded by the clone's tokenizer
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("pattern, command", [
    ("data/fineweb10B/fineweb_train_*.bin", "run python -m data.fineweb to write them"),
    ("data/edu_fineweb100B/edu_fineweb_val_*.bin", "run python -m data.fineweb --type edu --version 100B"),
    ("mine/*.bin", "the scripts in data/ write shards"),
])
def test_missing_shards_name_the_script_that_writes_them(tmp_path, pattern, command):
    with pytest.raises(DataError, match="no files match") as e:
        DataLoader(str(tmp_path / pattern), 4, 32)
    assert command in str(e.value)


def test_missing_default_model_says_data_gpt2_py(shards):
    train = clone_trainer(shards / "clone")
    proc = run_train(TINY[2:] + data_args() + ["-x", "1"], cwd=shards, check=False, train=train)
    line = one_line_error(proc)
    assert line == ("error: gpt2_124M_bf16.bin: no such file: python -m data.gpt2 writes GPT-2's weights "
                    "(gpt2_124M.bin, gpt2_124M_bf16.bin); or train from scratch with -e d12\n")


def test_test_gpt2_without_gpt2s_weights_says_data_gpt2_py(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "test_gpt2.py"), "-e", "gpt2_124M.bin", "-ds",
                           "gpt2_124M_debug_state.bin", "--backend", "numpy"], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert "gpt2_124M.bin: no such file: python -m data.gpt2 writes GPT-2's weights" in one_line_error(proc)


def test_offline_tinyshakespeare_names_both_local_files(tmp_path):
    """No network (a proxy that refuses every connection) and neither local file: one message for both."""
    e = {k: v for k, v in env().items() if k not in ("TINYSHAKESPEARE", "GPT2_VOCAB")}
    e.update(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9", no_proxy="")
    proc = subprocess.run([sys.executable, "-m", "data.tinyshakespeare", "--out", str(tmp_path),
                           "--tokenizer", str(tmp_path / "t.bin")], cwd=tmp_path, env=e, capture_output=True,
                          text=True, timeout=120)
    line = one_line_error(proc)
    assert line.startswith("error: cannot download https://") and line.rstrip().endswith(
        "offline? set TINYSHAKESPEARE=path/to/input.txt and GPT2_VOCAB=path/to/gpt2.tiktoken "
        "(make passes both on), or pass --input and --vocab")
    assert os.listdir(tmp_path) == []
    e["GPT2_VOCAB"] = str(tmp_path / "gpt2.tiktoken")   # a file there: the corpus's download fails first
    (tmp_path / "gpt2.tiktoken").write_text("")
    proc = subprocess.run([sys.executable, "-m", "data.tinyshakespeare", "--out", str(tmp_path),
                           "--tokenizer", str(tmp_path / "t.bin")], cwd=tmp_path, env=e, capture_output=True,
                          text=True, timeout=120)
    assert one_line_error(proc).rstrip().endswith(   # the ranks are given: only the corpus is missing
        "offline? set TINYSHAKESPEARE=path/to/input.txt (make passes it on), or pass --input")


def step(loss_z, norm_z):
    return SimpleNamespace(loss=3.25, grad_norm=1.5, loss_z=loss_z, norm_z=norm_z)


def test_step_line_is_llmcs_where_every_value_is_known_then_the_eta():
    line = step_line(199, 500, step(-0.5, 2.25), 3e-4, 123.456, 0.3361, 412345.6, "bf16", 37.1)
    assert line == ("step  200/500 | loss 3.250000 (-0.50z)| norm 1.5000 (+2.25z)| lr 3.00e-04 | 123.46 ms | "
                    "33.6% bf16 MFU | 412346 tok/s | ETA 37s")


def test_step_line_says_n_a_for_z_scores_before_their_window_fills_and_an_unknown_peak():
    line = step_line(0, 500, step(math.nan, math.nan), 3e-4, 123.456, None, 1000.0, "fp32", 61.7)
    assert line == ("step    1/500 | loss 3.250000 (z n/a)| norm 1.5000 (z n/a)| lr 3.00e-04 | 123.46 ms | "
                    "fp32 MFU n/a | 1000 tok/s | ETA 1m02s")


def test_eta_is_the_steps_left_times_the_ema_of_the_step_time():
    throughput = Throughput(tokens_per_step=256, flops_per_step=1e9, peak_flops=None)
    throughput.update(5000.0)                        # the first step (allocation): its own time, until there
    assert throughput.eta_s(10) == 50.0              # is an average that leaves it out, as tok/s does
    throughput.update(1000.0)
    assert throughput.eta_s(10) == pytest.approx(10.0)            # one step in the EMA, bias-corrected
    throughput.update(2000.0)
    ema = (0.95 * 0.05 * 1000 + 0.05 * 2000) / (1 - 0.95 ** 2)    # 1512.8 ms
    assert throughput.eta_s(100) == pytest.approx(ema * 100 / 1000)
    assert throughput.eta_s(0) == 0.0
    assert [duration(s) for s in (0, 59.4, 59.6, 187, 3599, 3600, 7530, 90000)] == \
        ["0s", "59s", "1m00s", "3m07s", "59m59s", "1h00m", "2h05m", "25h00m"]
