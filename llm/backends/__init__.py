"""Backends: the array module and the layer kernels the model is written against.

The model (llm/model.py) never asks which backend it runs on. It holds a backend object and calls the
ops below on that backend's arrays. Every array passed to an op is C-contiguous. Shapes use llm.c's
letters: B batch, T time, C channels, NH heads, OC output channels, V vocab, Vp padded vocab.

Attributes
  name          "numpy" or "cupy"
  xp            the array module (numpy or cupy)
  dtype         dtype of parameters, gradients and activations (float32, or bfloat16 on the GPU)
  precision     "fp32" or "bf16", for printing
  asarray(a, dtype=None)   host numpy array -> backend array (dtype defaults to a's)
  to_numpy(x)   backend array -> numpy array (bf16 becomes float32)
  copy_in(dst, a)   host numpy array a -> the existing backend array dst, same shape and dtype
  fetch(x)      start copying x to the host behind the work queued so far; returns a function that waits
                for that copy alone (not for work queued after it) and gives x as a host numpy array of
                x's dtype
  run(key, work)   run work(), a forward's or a backward's device work; with CUDA graphs on (the cupy backend
                in bf16, cuda_graph=True) the same key is run, then recorded, then replayed (graphs.py)
  cuda_graph    whether run() records and replays
  synchronize() wait for queued device work (no-op on numpy)
  device_name() what the backend computes on, for the printed config
  peak_flops()  the device's dense peak FLOP/s at this precision, for MFU; None where unknown
  memory_available()   the bytes this rank can still allocate where its arrays live: its share of the host's
                available memory (numpy), or of the GPU's free memory (cupy); None where unknown
  scratch_bytes(config, B, T)   the most the ops allocate beyond the model's buffers at (B, T), where known
                (both for the memory estimate, llm/memory.py)

Forward ops write their outputs. Backward ops OVERWRITE the gradient of their activation input
(dinp, dqkv) and ACCUMULATE (+=) into parameter gradients (dw, db, dwte, dwpe), as llm.c does, so that
gradient accumulation over micro-steps is free. layernorm_backward also accumulates into dinp, because
its dinp is the residual stream's gradient, which already holds the skip connection's share.

  encoder_forward(out, inp, wte, wpe)            out(B,T,C) = wte[inp] + wpe[:T]; inp int32 (B,T)
  encoder_backward(dwte, dwpe, dout, inp)        dwte[inp] += dout; dwpe[:T] += sum_b dout
  layernorm_forward(out, mean, rstd, inp, w, b)  mean, rstd: float32 (B,T); eps 1e-5
  residual_layernorm_forward(residual, out, mean, rstd, inp1, inp2, w, b)
                                                 residual = inp1 + inp2, then
                                                 layernorm_forward(out, .., residual)
  layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, dbias_below=None)   all +=; dbias_below +=
                                                 sum dinp after its update: the bias gradient of the
                                                 projection that added into the residual stream below
  matmul_forward(out, inp, w, bias)              out(B,T,OC) = inp(B,T,C) @ w(OC,C)^T + bias(OC)
                                                 (bias may be None)
  matmul_backward(dinp, dw, dbias, dout, inp, w) dinp = dout @ w;  dw += dout^T @ inp;  dbias += sum dout.
                                                 Returns `done`: dw may still be being computed (cupy: a
                                                 small one on a stream of its own, beside the ops queued
                                                 after it), and done names it for wait(); None when it is
                                                 already made
  wait(done)                                     the ops queued after this wait for the weight gradient
                                                 `done` names, and for those queued before it (None: no-op).
                                                 Before an op overwrites the dout or inp of a weight
                                                 gradient that may still run, the caller waits for it
  matmul_gelu_forward(out, gelu_out, inp, w, bias)   matmul_forward, then gelu_out = gelu(out)
                                                 (one fused GEMM)
  matmul_gelu_backward(dinp, dw, dbias, dout, inp, w, pre_gelu, dbias_prev, recompute)
                                                 the matmul after a GELU, inp = gelu(pre_gelu): first, when
                                                 recompute, inp = gelu(pre_gelu) is written; then
                                                 matmul_backward, dinp *= gelu'(pre_gelu), and dbias_prev +=
                                                 sum dinp (the bias gradient of the matmul that made
                                                 pre_gelu); returns matmul_backward's `done`
  attention_saved_shape(B, T, NH)                (shape, dtype) of what attention keeps for backward: the
                                                 probabilities (B,NH,T,T), or flash attention's lse (B,NH,T)
  attention_forward(out, saved, qkv, NH)         qkv (B,T,3C) -> out (B,T,C), causal; saved: the kept buffer
  attention_backward(dqkv, dbias, dout, qkv, out, saved, NH)   dqkv (B,T,3C) overwritten; out: the forward's
                                                 output; dbias (3C) += sum dqkv: the qkv layer's bias
                                                 gradient, summed where dqkv is made (may be None)
  gelu_forward(out, inp)                         out = gelu(inp), tanh GELU
  fused_classifier(logits, losses, targets, V, dloss)
                    logits (B,T,Vp); losses float32 (B,T) = -log softmax(logits[..., :V])[target].
                    With dloss not None, logits is overwritten by dlogits: (probs - onehot) * dloss
                    over the first V columns and 0 over the padding.
  adamw(param, grad, m, v, master, lr, beta1, beta2, eps, weight_decay, t, grad_scale)
                    one contiguous 1-D segment, updated in place; master is None or float32; grad_scale,
                    the clipping factor, a 0-d float32 backend array (read where it is, so the update
                    waits for no host): NaN leaves the segment as it is
  sumsq(x)          sum of squares of a 1-D array in float32, as a 0-d backend array (no host sync)
"""
from llm.launch import UserError, install

PRECISIONS = {"numpy": ("fp32",), "cupy": ("bf16", "fp32")}   # the first is each backend's default


class BackendError(UserError):
    """A backend that cannot be built here (unknown name, missing package, no GPU): one line saying why."""


def gpu_missing(otherwise="use --backend numpy"):
    """Why the cupy backend cannot run here (one line ending in what else to do), or None when cupy imports
    and sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return f"the cupy backend needs cupy: {install('gpu')} (or cupy-cuda13x), or {otherwise}"
    try:
        if cupy.cuda.is_available():
            return None
    except Exception:   # a broken driver or runtime counts as no GPU
        pass
    return f"the cupy backend needs a CUDA GPU, and none is usable here: {otherwise}"


def resolve(name="auto", precision="auto"):
    """(backend name, precision) with "auto" decided, here and only here: the cupy backend when a GPU is
    usable, else numpy; each backend's default precision (bf16 on the GPU, fp32 on the CPU).
    Raises BackendError (one line) for an unknown name or precision, and for cupy where it cannot run."""
    if name == "auto":
        name = "numpy" if gpu_missing() else "cupy"
    if name not in PRECISIONS:
        raise BackendError(f"unknown backend '{name}': choose numpy, cupy or auto")
    if name == "cupy" and (missing := gpu_missing()):
        raise BackendError(missing)
    if precision == "auto":
        precision = PRECISIONS[name][0]
    if precision not in PRECISIONS[name]:
        choices = " or ".join(PRECISIONS[name])
        raise BackendError(f"the {name} backend computes in {choices}, not '{precision}'")
    return name, precision


def get_backend(name="auto", precision="auto", allow_tf32=True, attention="auto", cuda_graph=False):
    """Build a backend (names and precisions as resolve()). Only the cupy backend imports cupy.

    attention: auto (flash attention in bf16 on the GPU, the naive one in fp32 and on the CPU), or cudnn:
    cuDNN's fused attention, bf16 on the GPU only. cuda_graph: replay each forward and backward as a CUDA
    graph where the backend can (the cupy backend in bf16; fp32's attention calls cuBLAS through CuPy,
    which refuses to be recorded)."""
    name, precision = resolve(name, precision)
    if attention not in ("auto", "cudnn"):
        raise BackendError(f"unknown attention '{attention}': choose auto or cudnn")
    if attention == "cudnn" and (name, precision) != ("cupy", "bf16"):
        raise BackendError("--attention cudnn runs in bf16 on the GPU only (--backend cupy --precision bf16)")
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        return NumpyBackend()
    from .cupy_backend import CupyBackend
    try:
        return CupyBackend(precision=precision, allow_tf32=allow_tf32,
                           attention="cudnn" if attention == "cudnn" else "flash", cuda_graph=cuda_graph)
    except ImportError as e:   # the cudnn option's package
        raise BackendError(str(e)) from None
