"""Choosing a backend: "auto" is decided in one place, and every impossible choice is one line, not a
traceback."""
import pytest

from llm.backends import BackendError, get_backend, gpu_missing, resolve


def test_auto_picks_numpy_in_fp32_without_a_gpu():
    if gpu_missing() is None:
        pytest.skip("this machine has a usable GPU: auto picks cupy")
    assert resolve("auto", "auto") == ("numpy", "fp32")
    assert get_backend().name == "numpy"


def test_precision_auto_is_each_backends_default():
    assert resolve("numpy", "auto") == ("numpy", "fp32")
    if gpu_missing() is None:
        assert resolve("cupy", "auto") == ("cupy", "bf16")
    else:   # without a GPU, asking for cupy is itself the error, before any precision
        with pytest.raises(BackendError, match="--backend numpy"):
            resolve("cupy", "auto")


@pytest.mark.parametrize("args, message", [
    (dict(name="torch"), "unknown backend 'torch': choose numpy, cupy or auto"),
    (dict(name="numpy", precision="bf16"), "the numpy backend computes in fp32, not 'bf16'"),
    (dict(name="numpy", attention="cudnn"), "--attention cudnn runs in bf16 on the GPU only"),
    (dict(attention="flashy"), "unknown attention 'flashy': choose auto or cudnn"),
])
def test_impossible_choices_are_one_clear_line(args, message):
    with pytest.raises(BackendError) as error:
        get_backend(**args)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.skipif(gpu_missing() is not None, reason="needs a usable GPU")
@pytest.mark.parametrize("args, message", [
    (dict(name="cupy", precision="fp16"), "the cupy backend computes in bf16 or fp32, not 'fp16'"),
    (dict(name="cupy", precision="fp32", attention="cudnn"),
     "--attention cudnn runs in bf16 on the GPU only"),
])
def test_impossible_gpu_choices_are_one_clear_line(args, message):
    with pytest.raises(BackendError, match=message):
        get_backend(**args)


def test_cupy_without_a_gpu_says_what_to_do():
    missing = gpu_missing()
    if missing is None:
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(BackendError, match="--backend numpy"):
        get_backend("cupy")
    assert "pip install -e \".[gpu]\"" in missing or "none is usable" in missing
