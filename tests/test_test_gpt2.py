"""test_gpt2.py itself: it passes on the trainer, reads llm.c-style debug states, and fails when it should."""
import os
import subprocess
import sys

import numpy as np
import pytest

from llm import formats
from llm.config import GPT2Config
from llm.layout import PARAM_NAMES, ParamViews
from llm.weight_init import init_params
from reference import gpt2 as ref
from conftest import REPO, env

TEST = os.path.join(REPO, "test_gpt2.py")


def run(*args, cwd=REPO):
    return subprocess.run([sys.executable, TEST, *args], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=300)


def test_test_gpt2_passes_against_the_float64_reference():
    proc = run()
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("overall okay: 1"), proc.stdout[-2000:]
    assert proc.stdout.count("OK (d") == 16 and "NOT OK" not in proc.stdout


def write_debug_state(tmp_path, config, params, corrupt=None):
    """A model file and a debug state in llm.c's formats, with the reference's numbers in float32."""
    rng = np.random.default_rng(5)
    x = rng.integers(0, config.vocab_size, (2, 16), dtype=np.int32)
    y = rng.integers(0, config.vocab_size, (2, 16), dtype=np.int32)
    p = ParamViews(params, config).copies(np.float64)
    logits, loss, cache = ref.gpt2_forward(p, config, x, y)
    grads = ref.gpt2_backward(p, config, cache)
    flat = np.concatenate([grads[name].ravel() for name in PARAM_NAMES]).astype(np.float32)
    if corrupt:
        getattr(ParamViews(flat, config), corrupt)[...] += 1.0
    formats.write_model(tmp_path / "model.bin", config, params)
    formats.write_debug_state(tmp_path / "debug.bin", x, y,
                              logits[..., :config.vocab_size].astype(np.float32), np.float32(loss), flat)


def test_test_gpt2_checks_a_model_against_a_debug_state_file(tmp_path):
    config = GPT2Config.from_descriptor("d2c64h4")
    write_debug_state(tmp_path, config, init_params(config))
    proc = run("-e", str(tmp_path / "model.bin"), "-ds", str(tmp_path / "debug.bin"))
    assert proc.returncode == 0 and "overall okay: 1" in proc.stdout, proc.stdout[-2000:]
    assert "testing against" in proc.stdout and "B=2 T=16" in proc.stdout


def test_test_gpt2_reports_a_wrong_gradient_and_exits_nonzero(tmp_path):
    config = GPT2Config.from_descriptor("d2c64h4")
    write_debug_state(tmp_path, config, init_params(config), corrupt="fcprojb")
    proc = run("-e", str(tmp_path / "model.bin"), "-ds", str(tmp_path / "debug.bin"))
    assert proc.returncode == 1 and "overall okay: 0" in proc.stdout
    assert "NOT OK (dfcprojb)" in proc.stdout and "OK (dfcw)" in proc.stdout


def test_test_gpt2_names_a_bad_debug_state_file(tmp_path):
    (tmp_path / "debug.bin").write_bytes(b"\0" * 2048)
    config = GPT2Config.from_descriptor("d2c64h4")
    formats.write_model(tmp_path / "model.bin", config, init_params(config))
    proc = run("-e", str(tmp_path / "model.bin"), "-ds", str(tmp_path / "debug.bin"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "debug.bin: bad magic 0" in proc.stderr


@pytest.mark.parametrize("damage, message", [
    (lambda x: x.__setitem__((1, 3), 60000), " to 60000, outside "),
    (lambda x: x.__setitem__((0, 0), -5), "debug.bin: token ids -5 to "),
])
def test_test_gpt2_names_a_debug_state_of_another_model(tmp_path, damage, message):
    """Token ids beyond the model's vocab were an IndexError traceback; negative ones, a silent NOT OK."""
    config = GPT2Config.from_descriptor("d2c64h4")
    write_debug_state(tmp_path, config, init_params(config))
    state = formats.read_debug_state(tmp_path / "debug.bin", config)
    damage(state["x"])
    formats.write_debug_state(tmp_path / "debug.bin", state["x"], state["y"], state["logits"], state["loss"],
                              state["grads"])
    proc = run("-e", str(tmp_path / "model.bin"), "-ds", str(tmp_path / "debug.bin"))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "outside" in proc.stderr and "'s vocab 0..50256: the debug state of another model?" in proc.stderr


def test_test_gpt2_with_a_model_but_no_debug_state_is_one_line():
    proc = run("-e", "gpt2_124M.bin")
    assert proc.returncode == 1
    assert proc.stderr == "error: -e and -ds go together: a model file and the debug state written with it\n"


def test_test_gpt2_refuses_a_model_whose_float64_reference_does_not_fit(monkeypatch):
    """--model d48's float64 reference needs about 93 GiB of host memory: without the count, the kernel's
    OOM killer ends the process, which prints nothing."""
    import test_gpt2
    from llm.backends import get_backend
    from llm.memory import NotEnoughMemory
    backend = get_backend("numpy")
    monkeypatch.setattr(type(backend), "memory_available", lambda self: 4 << 30)
    test_gpt2.check_memory(backend, GPT2Config.from_descriptor("d2c64h4"), 4, 32)
    with pytest.raises(NotEnoughMemory, match=r"the float64 reference 7\.4 GiB, .* and 4\.0 GiB is "
                                              r"available: use a smaller model"):
        test_gpt2.check_memory(backend, GPT2Config.from_descriptor("d12"), 4, 32)
