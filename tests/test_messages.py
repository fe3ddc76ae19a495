"""What a newcomer sees when something is missing: one line naming the file and the command that makes it,
and a step line that says "n/a" where a value is not known yet."""
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from llm.data import DataError, DataLoader
from llm.report import step_line
from conftest import REPO, TINY, data_args, env, run_train


def one_line_error(proc):
    """The process failed with exit status 1 and printed one line, "error: ...", and no traceback: that
    line."""
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_missing_default_data_says_run_make_data(tmp_path):
    line = one_line_error(run_train(TINY + ["-x", "1"], cwd=tmp_path, check=False))
    assert ("no files match -i/-j pattern 'data/tinyshakespeare/tiny_shakespeare_train.bin': "
            "run `make data` (or python -m data.tinyshakespeare) to write them") in line


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
    line = one_line_error(run_train(TINY[2:] + data_args() + ["-x", "1"], cwd=shards, check=False))
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


def step(loss_z, norm_z):
    return SimpleNamespace(loss=3.25, grad_norm=1.5, loss_z=loss_z, norm_z=norm_z)


def test_step_line_is_llmcs_where_every_value_is_known():
    line = step_line(199, 500, step(-0.5, 2.25), 3e-4, 123.456, 0.3361, 412345.6, "bf16")
    assert line == ("step  200/500 | loss 3.250000 (-0.50z)| norm 1.5000 (+2.25z)| lr 3.00e-04 | 123.46 ms | "
                    "33.6% bf16 MFU | 412346 tok/s")


def test_step_line_says_n_a_for_z_scores_before_their_window_fills_and_an_unknown_peak():
    line = step_line(0, 500, step(math.nan, math.nan), 3e-4, 123.456, None, 1000.0, "fp32")
    assert line == ("step    1/500 | loss 3.250000 (z n/a)| norm 1.5000 (z n/a)| lr 3.00e-04 | 123.46 ms | "
                    "fp32 MFU n/a | 1000 tok/s")
