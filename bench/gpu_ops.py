"""Time each op of the cupy backend at GPT-2 124M (d12) shapes: B=8, T=1024, C=768, NH=12, Vp=50304.

Every op runs a few times to warm up (compiling its kernels), then `--reps` times, each between two CUDA
events, behind a short spin kernel so that the host queues the reps ahead of the device and launch
gaps stay out of the numbers. The table gives the median per op, the bytes it must move over that time
and, for matmuls and attention, TFLOP/s. The last lines add the ops up into one d12 training step at this B.

Usage: python -m bench.gpu_ops [--precision bf16|fp32] [--reps 20] [--B 8]
"""
import statistics

import numpy as np

from bench import needs_gpu
from llm.config import GPT2Config
from llm.launch import Parser, positive_int, run
from reference.adamw import BETA1, BETA2, EPS

try:
    import cupy
except ImportError:   # needs_gpu() says so in one line
    cupy = None

SPIN = r'''
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
'''


def time_op(fn, reps, spin):
    """Median milliseconds of fn() over reps runs, each timed with its own pair of events."""
    for _ in range(3):
        fn()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    spin((1,), (1,), (np.int64(40_000_000),))  # about 20 ms: the host gets ahead of the device
    for start, end in events:
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events)


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--reps", type=positive_int, default=20)
    parser.add_argument("--B", type=positive_int, default=8)
    args = parser.parse_args(argv)
    needs_gpu()
    from llm.backends.attention import FlashAttention   # only once a GPU is known: these load cuBLAS
    from llm.backends.cupy_backend import CupyBackend

    be = CupyBackend(args.precision)
    d12 = GPT2Config()
    B, T, C, NH, V, Vp, L = (args.B, d12.max_seq_len, d12.channels, d12.num_heads, d12.vocab_size,
                             d12.padded_vocab_size, d12.num_layers)
    num_params = d12.num_parameters
    s = be.dtype.itemsize
    N = B * T
    rng = cupy.random.default_rng(0)

    def act(*shape, dtype=None, scale=1.0):
        return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype or be.dtype)

    x, dx, out = act(B, T, C), act(B, T, C), act(B, T, C)
    h, dh = act(B, T, 4 * C), act(B, T, 4 * C)
    w_ln, b_ln = act(C), act(C)
    mean, rstd = act(B, T, dtype=np.float32), act(B, T, dtype=np.float32)
    inp = rng.integers(0, V, (B, T), dtype=np.int32)
    targets = rng.integers(0, V, (B, T), dtype=np.int32)
    wte, dwte, wpe, dwpe = act(Vp, C, scale=0.02), act(Vp, C), act(T, C), act(T, C)
    qkv, dqkv = act(B, T, 3 * C), act(B, T, 3 * C)
    shape, dtype = be.attention_saved_shape(B, T, NH)
    att = cupy.empty(shape, dtype)
    logits = act(B, T, Vp)
    losses = cupy.empty((B, T), np.float32)
    params, grads = act(num_params, scale=0.02), act(num_params, scale=1e-3)
    m, v = cupy.zeros(num_params, np.float32), cupy.zeros(num_params, np.float32)
    master = params.astype(np.float32) if be.precision == "bf16" else None

    spin = cupy.RawKernel(SPIN, "spin")
    rows = []   # (name, ms, bytes, flops, count per step)

    def bench(name, fn, nbytes, flops=0, per_step=0):
        rows.append((name, time_op(fn, args.reps, spin), nbytes, flops, per_step))

    bench("encoder_forward", lambda: be.encoder_forward(out, inp, wte, wpe), 3 * N * C * s, per_step=1)
    bench("encoder_backward", lambda: be.encoder_backward(dwte, dwpe, dx, inp), 3 * N * C * s, per_step=1)
    bench("layernorm_forward", lambda: be.layernorm_forward(out, mean, rstd, x, w_ln, b_ln), 2 * N * C * s,
          per_step=1)
    db_below = act(C)   # as the model runs it: with the bias gradient of the projection below
    bench("layernorm_backward",
          lambda: be.layernorm_backward(dx, w_ln, b_ln, out, x, w_ln, mean, rstd, db_below),
          4 * N * C * s, per_step=2 * L + 1)
    for label, cin, cout, count in (("qkv", C, 3 * C, L), ("attproj", C, C, L), ("fc", C, 4 * C, L),
                                    ("fcproj", 4 * C, C, L), ("lm_head", C, Vp, 1)):
        a, da = act(B, T, cin), act(B, T, cin)
        y, dy = act(B, T, cout), act(B, T, cout)
        w, dw = act(cout, cin, scale=0.02), act(cout, cin)
        bias = act(cout) if label != "lm_head" else None
        mm_bytes = (N * cin + cin * cout + N * cout) * s
        bench(f"matmul_forward {label}", lambda: be.matmul_forward(y, a, w, bias), mm_bytes,
              2 * N * cin * cout, per_step=count)
        # as the model runs them: fc's bias gradient comes from fcproj's backward, which also applies the
        # GELU and -r 1's recompute; attproj's and fcproj's from the layernorm backward above them
        if label == "fcproj":
            pre, dbias_prev = act(B, T, cin), act(cin)
            bench("matmul_gelu_backward fcproj",
                  lambda: be.matmul_gelu_backward(da, dw, None, dy, a, w, pre, dbias_prev, True),
                  2 * mm_bytes + 3 * N * cin * s, 4 * N * cin * cout, per_step=count)
        else:
            bench(f"matmul_backward {label}",
                  lambda: be.matmul_backward(da, dw, None, dy, a, w),   # biases: the layers' neighbours
                  2 * mm_bytes, 4 * N * cin * cout, per_step=count)
    # causal attention's useful work: half of the (T, T) products, 2 in the forward (S = Q K^T, O = P V) and
    # 2.5 times as much in the backward, as FlashAttention-2 counts; bytes as flash attention moves them
    # (qkv in, out out; then qkv, out and dout in, dqkv out), not the (T, T) matrices fp32 keeps
    att_flops = 2 * B * NH * T * T * (C // NH)
    bench("attention_forward", lambda: be.attention_forward(out, att, qkv, NH), 4 * N * C * s, att_flops,
          per_step=L)
    dqkvb = act(3 * C)   # attention's backward sums qkv's bias gradient
    bench("attention_backward", lambda: be.attention_backward(dqkv, dqkvb, dx, qkv, out, att, NH),
          8 * N * C * s, 2.5 * att_flops, per_step=L)
    if be.attention.name == "flash-hopper":   # the kernels it replaces on Hopper, for comparison
        mma = FlashAttention(be.kernels, be.scratch)
        bench("attention_forward mma.sync", lambda: mma.forward(out, att, qkv, NH), 4 * N * C * s, att_flops)
        bench("attention_backward mma.sync", lambda: mma.backward(dqkv, dx, qkv, out, att, NH), 8 * N * C * s,
              2.5 * att_flops)
    res = act(B, T, C)
    bench("layernorm_forward + residual",
          lambda: be.residual_layernorm_forward(res, out, mean, rstd, x, dx, w_ln, b_ln),
          4 * N * C * s, per_step=2 * L)
    bench("gelu_forward", lambda: be.gelu_forward(h, dh), 2 * N * 4 * C * s)   # fp32's; bf16: in the GEMM
    bench("fused_classifier", lambda: be.fused_classifier(logits, losses, targets, V, 1.0 / N),
          2 * N * Vp * s, per_step=1)
    no_clip = be.asarray(np.array(1.0, np.float32))   # adamw's grad_scale, a device scalar
    bench("adamw (all params)",
          lambda: be.adamw(params, grads, m, v, master, 1e-4, BETA1, BETA2, EPS, 0.1, 1, no_clip),
          num_params * (3 * s + 16 + (8 if master is not None else 0)), per_step=1)
    bench("sumsq (all grads)", lambda: be.sumsq(grads), num_params * s, per_step=1)

    print(f"cupy backend, {args.precision}, B={B} T={T} C={C} NH={NH} Vp={Vp}; median of {args.reps} reps")
    print(f"{'op':<28}{'ms':>10}{'GB/s':>10}{'TFLOP/s':>10}")
    for name, ms, nbytes, flops, _ in rows:
        tflops = f"{flops / ms / 1e9:10.1f}" if flops else " " * 10
        print(f"{name:<28}{ms:10.3f}{nbytes / ms / 1e6:10.0f}{tflops}")   # per call
    step_ms = sum(ms * count for _, ms, _, _, count in rows)
    step_flops = sum(flops * count for _, _, _, flops, count in rows)
    print(f"sum over one d12 step (ops only, no launch gaps): {step_ms:.2f} ms, "
          f"{N / step_ms * 1e3:,.0f} tok/s, matmuls and attention {step_flops / step_ms / 1e9:.0f} TFLOP/s "
          "averaged over the step")


if __name__ == "__main__":
    run(main)
