"""The cupy backend computes what the numpy backend computes, op by op.

Each test builds random host inputs, runs the op on both backends and compares the outputs by relative
L2 error, ||gpu - ref|| / ||ref||: within 1e-5 in fp32 (TF32 off) and 1e-2 in bf16. Inputs are rounded
to the GPU's storage type first, so both backends see the same numbers. Outputs an op overwrites start
as NaN on the GPU (every element must be written); gradients an op accumulates into start random on
both sides (so += is checked, not =). Small shapes, plus GPT-2 124M's C=768, NH=12, T=1024 at B=2.

Skipped without cupy or without a usable CUDA device. Also runnable as a script:
python tests/test_cupy_backend.py
"""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")


def gpu_usable():
    try:
        return cupy.cuda.is_available()
    except Exception:  # a broken driver or runtime install counts as no GPU
        return False


if not gpu_usable():
    pytest.skip("needs a usable CUDA device", allow_module_level=True)

from llm.backends.cupy_backend import CupyBackend  # noqa: E402
from llm.backends.numpy_backend import NumpyBackend  # noqa: E402
from llm.config import GPT2Config  # noqa: E402

TOL = {"fp32": 1e-5, "bf16": 1e-2}
D12 = GPT2Config()   # GPT-2 124M
SHAPES = {"small": dict(B=2, T=32, C=64, NH=4),
          "gpt2": dict(B=2, T=D12.max_seq_len, C=D12.channels, NH=D12.num_heads)}
REF = NumpyBackend()


def REF_GELU(x):
    out = np.empty_like(x)
    REF.gelu_forward(out, x)
    return out


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def gpu(request):
    return CupyBackend(request.param, allow_tf32=False)


@pytest.fixture(params=list(SHAPES))
def shape(request):
    return SHAPES[request.param]


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "the GPU left NaN or inf in an output"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def rounded(gpu, a):
    """a as the GPU stores it, back in float32."""
    return a.astype(gpu.dtype).astype(np.float32)


def compare(gpu, op, args, check, poison=(), fp32=()):
    """Run `op` on both backends from the same host args; return {index: rel error} for the args in `check`.

    Float arrays go to the GPU in gpu.dtype (float32 for the indices in fp32), ints as int32. The args in
    `poison` start as NaN on the GPU: the op must overwrite them."""
    args = [rounded(gpu, a) if isinstance(a, np.ndarray) and a.dtype == np.float32 and i not in fp32 else a
            for i, a in enumerate(args)]
    ref_args = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    getattr(REF, op)(*ref_args)
    gpu_args = []
    for i, a in enumerate(args):
        if isinstance(a, np.ndarray):
            dtype = np.int32 if a.dtype.kind == "i" else (np.float32 if i in fp32 else gpu.dtype)
            a = gpu.asarray(a, dtype)
            if i in poison:
                poison_nan(a)
        gpu_args.append(a)
    getattr(gpu, op)(*gpu_args)
    errors = {i: rel_err(gpu.to_numpy(gpu_args[i]), ref_args[i]) for i in check}
    shown = ", ".join(f"{e:.2e}" for e in errors.values())
    print(f"{op:<20} {gpu.precision} {args[check[0]].shape}: {shown}")
    return errors


def poison_nan(x):
    if x.dtype == np.float32:
        x.fill(np.nan)
    else:
        x.view(cupy.uint16).fill(0x7FC0)  # a bf16 NaN


def assert_close(gpu, errors, factor=1.0):
    for i, e in errors.items():
        assert e < factor * TOL[gpu.precision], f"argument {i}: relative error {e:.3e}"


def randn(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def test_backend_attributes():
    bf16, fp32 = CupyBackend("bf16"), CupyBackend("fp32")
    assert (bf16.name, bf16.precision, bf16.dtype) == ("cupy", "bf16", ml_dtypes.bfloat16)
    assert fp32.dtype == np.float32
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8], np.float32)  # halfway cases round to even
    assert bf16.to_numpy(bf16.asarray(x, bf16.dtype)).tolist() == [1.0, 1.0, 1 + 2 ** -6]


def test_copies_in_and_out_keep_the_order_of_the_work_queued_around_them():
    """copy_in goes through one pinned buffer per destination and fetch reads into pinned memory, neither
    waiting for the GPU: each copy must still land between the work queued before and after it."""
    gpu = CupyBackend("bf16")
    dst, sums = cupy.zeros(1 << 20, np.int32), cupy.zeros(8, np.int64)
    cupy.cuda.runtime.deviceSynchronize()
    slow = cupy.ones(1 << 26, np.float32)
    for _ in range(20):   # queued work, so that the copies below are queued behind it
        slow *= 1.0
    for k in range(8):    # a refill of the same pinned buffer each time, with no wait in between
        gpu.copy_in(dst, np.full(dst.shape, k, np.int32))
        sums[k] = dst.sum()
    x = cupy.arange(4, dtype=np.float32)
    fetched = gpu.fetch(x)
    x += 10   # queued after the fetch: not in what it gives
    assert fetched().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert sums.get().tolist() == [k * (1 << 20) for k in range(8)]


def test_encoder_forward_and_backward_accumulate_into_dwte_and_dwpe(gpu, shape):
    rng = np.random.default_rng(1)
    B, T, C = shape["B"], shape["T"], shape["C"]
    Vp, maxT = 64, T + 8
    inp = rng.integers(0, 10, (B, T)).astype(np.int32)  # few distinct tokens: many repeats in dwte
    wte, wpe = randn(rng, Vp, C), randn(rng, maxT, C)
    assert_close(gpu, compare(gpu, "encoder_forward", [randn(rng, B, T, C), inp, wte, wpe], [0], poison=[0]))
    dwte, dwpe, dout = randn(rng, Vp, C), randn(rng, maxT, C), randn(rng, B, T, C)
    assert_close(gpu, compare(gpu, "encoder_backward", [dwte, dwpe, dout, inp], [0, 1]))


def test_layernorm_forward_and_backward_accumulate(gpu, shape):
    rng = np.random.default_rng(2)
    B, T, C = shape["B"], shape["T"], shape["C"]
    x, w, b = randn(rng, B, T, C, scale=2.0) + 0.5, randn(rng, C), randn(rng, C)
    out = np.zeros((B, T, C), np.float32)
    mean, rstd = np.zeros((B, T), np.float32), np.zeros((B, T), np.float32)
    assert_close(gpu, compare(gpu, "layernorm_forward", [out, mean, rstd, x, w, b], [0, 1, 2],
                              poison=[0, 1, 2], fp32=[1, 2]))
    REF.layernorm_forward(out, mean, rstd, rounded(gpu, x), rounded(gpu, w), rounded(gpu, b))
    dinp, dw, db, dout = randn(rng, B, T, C), randn(rng, C), randn(rng, C), randn(rng, B, T, C)
    assert_close(gpu, compare(gpu, "layernorm_backward", [dinp, dw, db, dout, x, w, mean, rstd], [0, 1, 2],
                              fp32=[6, 7]))
    dbias_below = randn(rng, C)   # with the column sums of dinp, the bias gradient of the projection below
    assert_close(gpu, compare(gpu, "layernorm_backward", [dinp, dw, db, dout, x, w, mean, rstd, dbias_below],
                              [0, 1, 2, 8], fp32=[6, 7]))
    residual, x2 = np.zeros((B, T, C), np.float32), randn(rng, B, T, C)
    assert_close(gpu, compare(gpu, "residual_layernorm_forward", [residual, out, mean, rstd, x, x2, w, b],
                              [0, 1, 2, 3], poison=[0, 1, 2, 3], fp32=[2, 3]))


def test_layernorm_backward_of_a_wide_row(gpu):
    """C = 1600 (GPT-2 1.5B): fewer warps a block, each with the bias gradient below as its third sum."""
    rng = np.random.default_rng(5)
    B, T, C = 2, 8, 1600
    x, w, b = randn(rng, B, T, C, scale=2.0) + 0.5, randn(rng, C), randn(rng, C)
    out, mean, rstd = (np.zeros(s, np.float32) for s in ((B, T, C), (B, T), (B, T)))
    REF.layernorm_forward(out, mean, rstd, rounded(gpu, x), rounded(gpu, w), rounded(gpu, b))
    args = [randn(rng, B, T, C), randn(rng, C), randn(rng, C), randn(rng, B, T, C), x, w, mean, rstd,
            randn(rng, C)]
    assert_close(gpu, compare(gpu, "layernorm_backward", args, [0, 1, 2, 8], fp32=[6, 7]))


@pytest.mark.parametrize("layer", ["qkv", "fcproj", "lm_head"])
def test_matmul_forward_and_backward(gpu, shape, layer):
    rng = np.random.default_rng(3)
    B, T, C = shape["B"], shape["T"], shape["C"]
    cin, cout = {"qkv": (C, 3 * C), "fcproj": (4 * C, C), "lm_head": (C, 128)}[layer]
    has_bias = layer != "lm_head"
    inp, w = randn(rng, B, T, cin), randn(rng, cout, cin, scale=cin ** -0.5)
    bias = randn(rng, cout) if has_bias else None
    assert_close(gpu, compare(gpu, "matmul_forward", [np.zeros((B, T, cout), np.float32), inp, w, bias], [0],
                              poison=[0]))
    dinp, dw, dout = np.zeros((B, T, cin), np.float32), randn(rng, cout, cin), randn(rng, B, T, cout)
    dbias = randn(rng, cout) if has_bias else None
    check = [0, 1, 2] if has_bias else [0, 1]
    assert_close(gpu, compare(gpu, "matmul_backward", [dinp, dw, dbias, dout, inp, w], check, poison=[0]))


@pytest.mark.parametrize("recompute", [False, True])
def test_matmul_with_gelu_fused_forward_and_backward(gpu, shape, recompute):
    """The fc layer's GEMM with bias and GELU in its epilogue, and the fcproj backward whose one pass over
    dfch applies GELU's derivative, sums fc's bias gradient and (recompute) writes the GELU's output
    again, against the NumPy backend's matmul then gelu."""
    rng = np.random.default_rng(11)
    B, T, C = shape["B"], shape["T"], shape["C"]
    inp, w, bias = randn(rng, B, T, C), randn(rng, 4 * C, C, scale=C ** -0.5), randn(rng, 4 * C, scale=0.5)
    out, gelu_out = np.zeros((B, T, 4 * C), np.float32), np.zeros((B, T, 4 * C), np.float32)
    assert_close(gpu, compare(gpu, "matmul_gelu_forward", [out, gelu_out, inp, w, bias], [0, 1],
                              poison=[0, 1]))
    pre = randn(rng, B, T, 4 * C)
    gelu_inp = np.zeros_like(pre) if recompute else REF_GELU(rounded(gpu, pre))
    dinp, dw, dbias = np.zeros((B, T, 4 * C), np.float32), randn(rng, C, 4 * C), randn(rng, C)
    dout, w2, dbias_prev = randn(rng, B, T, C), randn(rng, C, 4 * C, scale=(4 * C) ** -0.5), randn(rng, 4 * C)
    args = [dinp, dw, dbias, dout, gelu_inp, w2, pre, dbias_prev, recompute]
    assert_close(gpu, compare(gpu, "matmul_gelu_backward", args, [0, 1, 2, 4, 7],
                              poison=[0, 4] if recompute else [0]))


def run_attention(backend, qkv, dout, NH, dtype, poison=False):
    """Forward then backward on one backend; returns (out, dqkv, dbias) on the host as float32, dbias the
    qkv bias gradient that the backward adds into (from 0.5)."""
    B, T, C3 = qkv.shape
    shape, att_dtype = backend.attention_saved_shape(B, T, NH)
    out = backend.asarray(np.zeros((B, T, C3 // 3), np.float32), dtype)
    dqkv = backend.asarray(np.zeros((B, T, C3), np.float32), dtype)
    dbias = backend.asarray(np.full(C3, 0.5, np.float32), dtype)
    att = backend.xp.zeros(shape, att_dtype)
    if poison:
        for x in (out, dqkv, att):
            poison_nan(x)
    qkv, dout = backend.asarray(qkv, dtype), backend.asarray(dout, dtype)
    backend.attention_forward(out, att, qkv, NH)
    backend.attention_backward(dqkv, dbias, dout, qkv, out, att, NH)
    return backend.to_numpy(out), backend.to_numpy(dqkv), backend.to_numpy(dbias)


def test_attention_forward_and_backward(gpu, shape):
    rng = np.random.default_rng(4)
    B, T, C, NH = shape["B"], shape["T"], shape["C"], shape["NH"]
    qkv, dout = rounded(gpu, randn(rng, B, T, 3 * C)), rounded(gpu, randn(rng, B, T, C))
    ref = run_attention(REF, qkv, dout, NH, np.float32)
    got = run_attention(gpu, qkv, dout, NH, gpu.dtype, poison=True)
    errors = {name: rel_err(g, r) for name, g, r in zip(("out", "dqkv", "dbias"), got, ref)}
    shown = ", ".join(f"{e:.2e}" for e in errors.values())
    print(f"attention            {gpu.precision} {qkv.shape}: {shown}")
    assert_close(gpu, errors)


def cudnn_usable():
    try:
        import llm.backends.cudnn_attention  # noqa: F401
        return True
    except ImportError:
        return False


def attention_backend(attention):
    """A bf16 backend with the named attention: "flash" is the default's (on Hopper, the wgmma kernels),
    "flash-mma" the mma.sync kernels that run on any GPU, "cudnn" cuDNN's."""
    from llm.backends.attention import FlashAttention
    gpu = CupyBackend("bf16", attention="cudnn" if attention == "cudnn" else "flash")
    if attention == "flash-mma":
        gpu.attention = FlashAttention(gpu.kernels, gpu.scratch)
    return gpu


ODD_SIZES = [(T, 2, hs) for T in (1, 37, 129) for hs in (16, 32, 64)] + [(100, 3, 16), (1024, 2, 64)]


@pytest.mark.parametrize("attention", ["flash", "flash-mma", pytest.param("cudnn", marks=pytest.mark.skipif(
    not cudnn_usable(), reason="needs cuDNN's frontend (pip install .[cudnn])"))])
@pytest.mark.parametrize("T, NH, hs", ODD_SIZES)
def test_fused_attention_matches_the_naive_attention_at_odd_sizes(attention, T, NH, hs):
    """bf16 flash attention (each kernel, and cuDNN's) against the float64 naive reference: T not a multiple
    of the tiles, T = 1, head sizes 16, 32 and 64. It also runs twice to the same bits (no atomics), and
    the saved lse is the log-sum-exp of each row's causal scores (flash attention keeps it in log2 units)."""
    import reference as ref_math
    if attention == "cudnn" and T == 1:
        pytest.skip("cuDNN's attention does not take T = 1 (the next test: one line)")
    gpu = attention_backend(attention)
    rng = np.random.default_rng(T)
    B, C = 2, NH * hs
    qkv, dout = rounded(gpu, randn(rng, B, T, 3 * C)), rounded(gpu, randn(rng, B, T, C))
    out64, att64 = ref_math.attention_forward(qkv.astype(np.float64), NH)
    dqkv64 = ref_math.attention_backward(dout.astype(np.float64), qkv.astype(np.float64), att64, NH)
    g_qkv, g_dout = gpu.asarray(qkv, gpu.dtype), gpu.asarray(dout, gpu.dtype)
    runs = []
    for _ in range(2):
        out, dqkv = gpu.xp.zeros((B, T, C), gpu.dtype), gpu.xp.zeros((B, T, 3 * C), gpu.dtype)
        dbias = gpu.xp.zeros(3 * C, gpu.dtype)   # the qkv bias gradient, dqkv's column sums
        poison_nan(out)
        poison_nan(dqkv)
        lse = gpu.xp.full(gpu.attention_saved_shape(B, T, NH)[0], np.nan, np.float32)
        gpu.attention_forward(out, lse, g_qkv, NH)
        gpu.attention_backward(dqkv, dbias, g_dout, g_qkv, out, lse, NH)
        runs.append((gpu.to_numpy(out), gpu.to_numpy(dqkv), lse.get(), gpu.to_numpy(dbias)))
    (out, dqkv, lse, dbias), again = runs
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], again))
    # the sums of the bf16 dqkv as written, to fp32 rounding and the bias's one bf16 rounding
    sums = dqkv.astype(np.float64).sum(axis=(0, 1))
    assert (np.abs(dbias - sums) <= 2 ** -8 * np.abs(sums) + 1e-5 * np.abs(dqkv).sum(axis=(0, 1))).all()
    q, k, _ = ref_math.attention.split_heads(qkv.astype(np.float64), NH)
    scores = np.where(np.tril(np.ones((T, T), bool)), q @ k.swapaxes(-1, -2) / np.sqrt(hs), -np.inf)
    lse64 = np.logaddexp.reduce(scores, axis=-1) * (1.0 if attention == "cudnn" else np.log2(np.e))
    errors = {"out": rel_err(out, out64), "dqkv": rel_err(dqkv, dqkv64), "lse": rel_err(lse, lse64),
              "dbias": rel_err(dbias, dqkv64.sum(axis=(0, 1)))}
    print(f"{attention} attention      bf16 B={B} T={T} NH={NH} hs={hs}: "
          + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
    assert errors["out"] < 1e-2 and errors["dqkv"] < 2e-2 and errors["lse"] < 1e-3 and errors["dbias"] < 2e-2


@pytest.mark.parametrize("T", [129, 1000, 1024])
def test_hopper_dq_consumers_give_the_same_bits(T):
    """The Hopper dQ kernel with three consumer warpgroups, whose rows past T are skipped, writes the bits of
    two: a row's products and its 16-row bias sums run in the same order either way."""
    from llm.backends.attention import HopperFlashAttention
    gpu = attention_backend("flash")
    if not isinstance(gpu.attention, HopperFlashAttention):
        pytest.skip("needs a Hopper GPU (the wgmma kernels)")
    rng = np.random.default_rng(T)
    B, NH, hs = 2, 3, 64
    qkv, dout = (gpu.asarray(randn(rng, B, T, n * NH * hs), gpu.dtype) for n in (3, 1))
    out = gpu.xp.zeros((B, T, NH * hs), gpu.dtype)
    lse = gpu.xp.zeros(gpu.attention_saved_shape(B, T, NH)[0], np.float32)
    gpu.attention_forward(out, lse, qkv, NH)
    runs = []
    for consumers in (2, 3):
        gpu.attention.CONSUMERS = dict(HopperFlashAttention.CONSUMERS, flash_backward_dq=consumers)
        dqkv = gpu.xp.zeros((B, T, 3 * NH * hs), gpu.dtype)
        sums = gpu.attention.backward(dqkv, dout, qkv, out, lse, NH)
        runs.append((gpu.to_numpy(dqkv), sums.get()))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


@pytest.mark.skipif(not cudnn_usable(), reason="needs cuDNN's frontend (pip install .[cudnn])")
def test_a_shape_cudnn_does_not_take_is_one_line():
    from llm.backends import BackendError
    gpu = attention_backend("cudnn")
    qkv, out = gpu.xp.zeros((2, 1, 3 * 64), gpu.dtype), gpu.xp.zeros((2, 1, 64), gpu.dtype)
    lse = gpu.xp.zeros(gpu.attention_saved_shape(2, 1, 1)[0], np.float32)
    with pytest.raises(BackendError, match="cuDNN cannot run attention at B=2 T=1") as error:
        gpu.attention_forward(out, lse, qkv, 1)
    assert "\n" not in str(error.value)


def test_gelu_forward(gpu, shape):
    rng = np.random.default_rng(5)
    B, T, C = shape["B"], shape["T"], shape["C"]
    h = randn(rng, B, T, 4 * C, scale=2.0)
    assert_close(gpu, compare(gpu, "gelu_forward", [np.zeros_like(h), h], [0], poison=[0]))


@pytest.mark.parametrize("vocab", [(100, 128), (D12.vocab_size, D12.padded_vocab_size)])
@pytest.mark.parametrize("with_grad", [True, False])
def test_fused_classifier_losses_and_dlogits(gpu, vocab, with_grad):
    rng = np.random.default_rng(6)
    (V, Vp), (B, T) = vocab, (2, 64)
    logits = randn(rng, B, T, Vp, scale=3.0)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    losses = np.zeros((B, T), np.float32)
    dloss = 1.0 / (B * T) if with_grad else None
    errors = compare(gpu, "fused_classifier", [logits, losses, targets, V, dloss], [0, 1], poison=[1],
                     fp32=[1])
    assert_close(gpu, errors)


def test_fused_classifier_zeroes_the_padded_dlogits(gpu):
    rng = np.random.default_rng(7)
    V, Vp = 100, 128
    logits = gpu.asarray(randn(rng, 1, 8, Vp), gpu.dtype)
    gpu.fused_classifier(logits, gpu.xp.zeros((1, 8), np.float32), gpu.asarray(np.arange(8, dtype=np.int32)),
                         V, 0.125)
    dlogits = gpu.to_numpy(logits)
    assert (dlogits[..., V:] == 0).all()
    assert np.abs(dlogits[..., :V].sum(-1)).max() < 1e-3  # softmax - onehot sums to 0 in each row


# (where m, v and the master start, where the parameter and its gradient start), in elements: a segment
# starts anywhere, and a ZeRO shard's parameters at another offset than its m and v
ADAMW_OFFSETS = [(0, 0), (3, 3), (1, 2)]


@pytest.mark.parametrize("use_master", [True, False])
@pytest.mark.parametrize("offsets", ADAMW_OFFSETS)
def test_adamw_updates_param_m_v_and_master(gpu, use_master, offsets):
    if use_master and gpu.precision == "fp32":
        pytest.skip("fp32 params need no master copy")
    rng = np.random.default_rng(8)
    n = 10_001  # odd: a segment need not be a multiple of anything
    state_at, param_at = offsets

    def placed(a, at, dtype=None):   # a device copy of a that starts `at` elements into its buffer
        return gpu.asarray(np.concatenate([np.zeros(at, a.dtype), a]), dtype)[at:]
    param, grad = rounded(gpu, randn(rng, n)), rounded(gpu, randn(rng, n, scale=0.1))
    m, v = randn(rng, n, scale=0.01), np.abs(randn(rng, n, scale=1e-4))
    hyper = (1e-2, 0.9, 0.95, 1e-8, 0.1, 3)  # lr, beta1, beta2, eps, weight_decay, t
    scale = np.array(0.5, np.float32)          # grad_scale, a 0-d array where the backend computes
    ref = [param.copy(), m.copy(), v.copy()]
    REF.adamw(ref[0], grad, ref[1], ref[2], None, *hyper, scale)
    g_param, g_grad = placed(param, param_at, gpu.dtype), placed(grad, param_at, gpu.dtype)
    g_m, g_v = placed(m, state_at), placed(v, state_at)
    g_master = placed(param, state_at) if use_master else None
    gpu.adamw(g_param, g_grad, g_m, g_v, g_master, *hyper, gpu.asarray(scale))
    errors = {"param": rel_err(gpu.to_numpy(g_param), ref[0]),
              "m": rel_err(gpu.to_numpy(g_m), ref[1]), "v": rel_err(gpu.to_numpy(g_v), ref[2])}
    if use_master:
        errors["master"] = rel_err(gpu.to_numpy(g_master), ref[0])
        # the bf16 param is the master rounded to nearest
        assert np.array_equal(gpu.to_numpy(g_param), rounded(gpu, gpu.to_numpy(g_master)))
    print(f"adamw                {gpu.precision} master={use_master} offsets {offsets}: "
          + ", ".join(f"{k} {e:.2e}" for k, e in errors.items()))
    assert errors.pop("param") < TOL[gpu.precision]
    assert max(errors.values()) < 1e-5  # m, v and master are fp32 in both precisions


def test_adamw_with_a_nan_grad_scale_changes_nothing(gpu):
    """NaN is clip_scale's answer for a step with a non-finite loss or norm, read on the device."""
    rng = np.random.default_rng(9)
    param, grad, m, v = (gpu.asarray(randn(rng, 1000), dtype) for dtype in (gpu.dtype, gpu.dtype, None, None))
    master = gpu.asarray(gpu.to_numpy(param)) if gpu.precision == "bf16" else None
    before = [gpu.to_numpy(x) for x in (param, m, v)]
    nan = gpu.asarray(np.array(np.nan, np.float32))
    gpu.adamw(param, grad, m, v, master, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, nan)
    for got, old in zip((param, m, v), before):
        np.testing.assert_array_equal(gpu.to_numpy(got), old)


def test_sumsq_is_float32_deterministic_and_takes_unaligned_segments(gpu):
    rng = np.random.default_rng(9)
    x = rounded(gpu, randn(rng, 1_000_003))
    xg = gpu.asarray(x, gpu.dtype)
    segment = xg[3:]  # starts 3 elements in: no 16-byte alignment
    total = gpu.sumsq(segment)
    assert total.shape == () and total.dtype == np.float32
    expected = float(np.sum(x[3:].astype(np.float64) ** 2))
    assert abs(float(total) - expected) / expected < 1e-5
    assert float(gpu.sumsq(segment)) == float(total)
    assert float(gpu.sumsq(xg[3:8])) == pytest.approx(float(np.sum(x[3:8].astype(np.float64) ** 2)), rel=1e-6)
    print(f"sumsq                {gpu.precision}: {abs(float(total) - expected) / expected:.2e}")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))


@pytest.mark.parametrize("attention", ["flash", pytest.param("cudnn", marks=pytest.mark.skipif(
    not cudnn_usable(), reason="needs nvidia-cudnn-frontend"))])
def test_training_replayed_from_cuda_graphs_equals_training_without_to_the_bit(attention):
    from llm.comm import SingleComm
    from llm.config import GPT2Config
    from llm.model import GPT2
    from llm.outliers import UpdateGuard
    from llm.step import train_step
    from llm.weight_init import init_params
    from llm.zero import ZeroOptimizer
    config = GPT2Config.from_descriptor("d2c64h4")
    params = init_params(config)
    rng = np.random.default_rng(0)
    steps = [[tuple(rng.integers(0, config.vocab_size, (2, 2, 32), dtype=np.int32)) for _ in range(2)]
             for _ in range(5)]   # 5 steps of 2 micro-batches: graphs recorded at step 2, replayed after

    def train(cuda_graph):
        model = GPT2(config, CupyBackend("bf16", attention=attention, cuda_graph=cuda_graph))
        model.load_params(params)
        optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.1)
        guard = UpdateGuard()
        losses = [train_step(model, optimizer, batches, 1e-3, t + 1, guard).loss
                  for t, batches in enumerate(steps)]
        val = model.validate(*steps[0][0]).get()
        return model, losses, model.params_numpy(), val

    eager, graphed = train(False), train(True)
    recorded = graphed[0].backend.graphs.graphs
    assert recorded and all(g is not None for g in recorded.values())
    assert not eager[0].backend.graphs.graphs
    assert graphed[1] == eager[1]
    np.testing.assert_array_equal(graphed[2], eager[2])
    np.testing.assert_array_equal(graphed[3], eager[3])
