"""Timing, run as modules from the repository's root: python -m bench.step (one training step and where
its time goes), python -m bench.gpu_ops (each GPU op alone), python -m bench.torch_gpt2 (PyTorch's step,
to compare)."""
# before any module here imports numpy: a missing package is one line (llm/__init__.py)
import llm   # noqa: F401
