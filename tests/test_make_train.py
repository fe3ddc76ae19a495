"""The quick start: `make train` prepares tiny Shakespeare and trains a small model whose loss clearly falls."""
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO, STEP_LINE, env

SHARED = os.path.join(REPO, "..", "shared", "data")
have_data = os.environ.get("GPT2_VOCAB") or os.path.exists(os.path.join(SHARED, "gpt2.tiktoken"))


@pytest.mark.skipif(shutil.which("make") is None or not have_data,
                    reason="needs make and a local gpt2.tiktoken (GPT2_VOCAB or ../shared/data)")
def test_make_train_loss_falls_and_prints_a_decoded_sample():
    proc = subprocess.run(["make", "-s", "train"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [float(m.group(3)) for line in proc.stdout.splitlines() if (m := STEP_LINE.match(line))]
    assert len(losses) >= 100
    assert losses[-1] < losses[0] - 4.0, (losses[0], losses[-1])   # from ~10.9 to ~5
    sample = proc.stdout.split("generating:\n---\n")[-1].split("\n---")[0]
    assert len(re.findall(r"[A-Za-z]{3,}", sample)) >= 5, sample     # words, not token ids
