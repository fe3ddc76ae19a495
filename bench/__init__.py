"""Timing, run as modules from the repository's root: python -m bench.step (one training step and where
its time goes), python -m bench.gpu_ops (each GPU op alone), python -m bench.gemms (each GEMM of the step
with every cuBLASLt candidate), python -m bench.torch_gpt2 (PyTorch's step, to compare)."""
# before any module here imports numpy: a missing package is one line (llm/__init__.py)
import llm   # noqa: F401
import argparse
from importlib.util import find_spec
import math

from llm.backends import BackendError, gpu_missing
from llm.launch import UserError, positive_int


def model_arguments(parser):
    """--model, -b and -t, with the GPU benchmarks' defaults: GPT-2 124M, B=64, T=1024."""
    parser.add_argument("--model", default="d12")
    parser.add_argument("-b", type=positive_int, default=64)
    parser.add_argument("-t", type=positive_int, default=1024)


def check_length(parser, model, config, T):
    """-t must fit the model's positions (wpe's rows): a longer one is the parser's one-line error."""
    if T > config.max_seq_len:
        parser.error(f"-t {T} is longer than {model}'s {config.max_seq_len} positions")


def positive_number(text):
    """An argparse type: a finite number above 0, where 0, a negative, nan or inf would make every figure
    compared with it meaningless (a fraction of -5 tok/s, a tolerance of nan)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"needs a finite number above 0, got '{text}'")
    return value


def needs(*packages):
    """Stop with one line unless these packages, which some benchmarks need and the project never does
    (torch, transformers), are installed. Such a module calls it as it loads, before it imports them."""
    missing = [name for name in packages if find_spec(name) is None]
    if missing:
        raise SystemExit(f"error: this needs {' and '.join(missing)} (pip install {' '.join(missing)}), "
                         "which the project itself never needs")


ON_A_GPU = "run this benchmark on a machine with a CUDA GPU"   # it has no CPU path, unlike bench.step


def needs_gpu():
    """Stop with one line unless cupy imports and sees a CUDA GPU (llm.backends.gpu_missing). Call it before
    importing llm.backends.cupy_backend, which loads cuBLAS."""
    if missing := gpu_missing(otherwise=ON_A_GPU):
        raise BackendError(missing)


def needs_torch_gpu(torch):
    """Stop with one line unless torch sees a CUDA GPU (a CPU build of torch never does)."""
    if not torch.cuda.is_available():
        raise UserError(f"torch {torch.__version__} finds no usable CUDA GPU here: {ON_A_GPU} and a CUDA "
                        "build of torch")
