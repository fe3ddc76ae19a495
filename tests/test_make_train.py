"""The quick start: `make train` prepares tiny Shakespeare and trains a small model whose loss clearly falls.

The test runs the Makefile's own recipe, with fewer steps, in a copy of the sources: the user's log_train/,
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
STEPS = 50    # of make train's 250: the loss is below 6.5 by then


def copy_sources(dest):
    """What `make train` reads: the Makefile, the trainer, llm/ and the data scripts."""
    os.makedirs(dest / "data")
    for name in ("Makefile", "pyproject.toml", "train_gpt2.py"):
        shutil.copy2(os.path.join(REPO, name), dest / name)
    shutil.copytree(os.path.join(REPO, "llm"), dest / "llm", ignore=shutil.ignore_patterns("__pycache__"))
    for script in glob.glob(os.path.join(REPO, "data", "*.py")):
        shutil.copy2(script, dest / "data")


@pytest.mark.skipif(shutil.which("make") is None or not have_data,
                    reason="needs make and a local gpt2.tiktoken (GPT2_VOCAB or ../shared/data)")
def test_make_train_loss_falls_and_prints_a_decoded_sample(tmp_path):
    copy_sources(tmp_path)
    # this interpreter instead of .venv's, and the venv taken as installed: the copy has none of its own
    make = ["make", "-s", "-o", ".venv/.installed", f"PY={sys.executable}",
            f"SHARED={os.path.abspath(SHARED)}", f"TRAIN_STEPS={STEPS}", "train"]
    proc = subprocess.run(make, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [float(m.group(3)) for line in proc.stdout.splitlines() if (m := STEP_LINE.match(line))]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 4.0, (losses[0], losses[-1])   # from ~10.9 to below 7
    sample = proc.stdout.split("generating:\n---\n")[-1].split("\n---")[0]
    assert len(re.findall(r"[A-Za-z]{3,}", sample)) >= 5, sample     # words, not token ids
    assert os.path.exists(tmp_path / "log_train" / f"model_{STEPS:08d}.bin")   # for python -m llm.sample
