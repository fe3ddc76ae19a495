"""Every GEMM of one training step, as the backend calls it, with each of cuBLASLt's candidate algorithms
timed alone: whether the candidate the backend keeps (llm/backends/cuda.py: BlasLt) is the fastest, and how
near each shape comes to the GPU's matrix rate.

    python -m bench.gemms [--model d12] [-b 64] [-t 1024] [--reps 15]

The backend's own matmul ops run once for each layer kind (qkv, attproj, fc, fcproj, lm_head) while the
GEMMs they issue are written down; each one is then timed as the backend runs it (its kept candidate), and
again with every candidate of its plan (bench.gpu_ops.time_op: the median of --reps runs). A row gives the
GEMM's calls a step, the kept and the best candidate's ms, TFLOP/s at the kept one, and every candidate's
ms in the heuristic's order. Then each biased layer's forward GEMM with each epilogue BlasLt has (none,
bias, and fc's GELU with bias keeping its input), to show what an epilogue costs; and the sums over the
step.
"""
import contextlib

import numpy as np

from bench import check_length, model_arguments, needs_gpu
from bench.gpu_ops import SPIN, time_op
from llm.config import GPT2Config
from llm.launch import Parser, positive_int, run

KIND = {("T", "N"): "forward", ("N", "N"): "dinp", ("N", "T"): "dweight"}   # by (transa, transb)


@contextlib.contextmanager
def recording(lt):
    """Within it, each lt.matmul call runs and is kept as (args, kwargs, its plan's key): each call plans
    anew, in a plan table of its own, so that its key is the one plan made; a plan of the same key made
    before is the one kept."""
    calls, matmul = [], lt.matmul

    def record(*args, **kwargs):
        plans, lt.plans = lt.plans, {}
        try:
            matmul(*args, **kwargs)
            (key,) = lt.plans
        finally:
            for made, plan in lt.plans.items():
                plans.setdefault(made, plan)
            lt.plans = plans
        calls.append((args, kwargs, key))

    lt.matmul = record
    try:
        yield calls
    finally:
        del lt.matmul   # BlasLt's own method again


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--reps", type=positive_int, default=15)
    args = parser.parse_args(argv)
    config = GPT2Config.from_descriptor(args.model)
    check_length(parser, args.model, config, args.t)
    needs_gpu()
    # once a GPU is known: cupy may be missing, and the backend loads cuBLAS as it is imported
    import cupy
    from llm.backends.cupy_backend import CupyBackend
    be = CupyBackend("bf16")
    spin = cupy.RawKernel(SPIN, "spin")
    rng = cupy.random.default_rng(0)
    N, C, L, Vp = args.b * args.t, config.channels, config.num_layers, config.padded_vocab_size

    def act(*shape):
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(be.dtype)

    def timed(call, algo=None):
        """ms of one recorded GEMM, with its kept candidate or with algo (nan where cuBLASLt refuses it)"""
        gemm_args, kwargs, key = call
        plan = be.lt.plans[key]
        kept, plan[3] = plan[3], algo or plan[3]
        try:
            return time_op(lambda: be.lt.matmul(*gemm_args, **kwargs), args.reps, spin)
        except RuntimeError:   # BlasLt's check of a cuBLAS status
            return float("nan")
        finally:
            plan[3] = kept

    print(f"{args.model} B={args.b} T={args.t} on {be.device_name()}: each GEMM, median of {args.reps} runs")
    print(f"{'GEMM':<22}{'calls':>6}{'kept ms':>9}{'best ms':>9}{'TFLOP/s':>9}  every candidate's ms")
    kept_sum = best_sum = 0.0
    for label, cin, cout, count in (("qkv", C, 3 * C, L), ("attproj", C, C, L), ("fc", C, 4 * C, L),
                                    ("fcproj", 4 * C, C, L), ("lm_head", C, Vp, 1)):
        x, dx, y, dy = act(N, cin), act(N, cin), act(N, cout), act(N, cout)
        w, dw, bias = act(cout, cin), act(cout, cin), act(cout) if label != "lm_head" else None
        with recording(be.lt) as calls:
            if label == "fc":
                be.matmul_gelu_forward(act(N, cout), y, x, w, bias)
            else:
                be.matmul_forward(y, x, w, bias)
            be.matmul_backward(dx, dw, None, dy, x, w)
        for call in calls:
            kept = timed(call)
            every = [timed(call, algo) for algo in be.lt.plans[call[2]][2]]
            best = np.nanmin(every)
            kept_sum, best_sum = kept_sum + kept * count, best_sum + best * count
            name = f"{label} {KIND[call[0][:2]]}"
            print(f"{name:<22}{count:>6}{kept:9.3f}{best:9.3f}{2 * N * cin * cout / kept / 1e9:9.0f}  "
                  + " ".join(f"{ms:.3f}" for ms in every), flush=True)
        if bias is not None:   # the forward GEMM with each epilogue
            epilogues = [("none", {}), ("bias", {"bias": bias})]
            if label == "fc":
                epilogues.append(("gelu_aux_bias", {"bias": bias, "aux": act(N, cout), "aux_ld": cout}))
            for epilogue, extra in epilogues:
                with recording(be.lt) as calls:
                    be.lt.matmul("T", "N", cout, N, cin, w, cin, x, cin, y, cout, epilogue=epilogue, **extra)
                print(f"  {label} forward, epilogue {epilogue}: {timed(calls[0]):.3f} ms")
        del x, dx, y, dy, w, dw
    print(f"the step's GEMMs: {kept_sum:.2f} ms with the kept candidates, {best_sum:.2f} with the best of "
          "each")


if __name__ == "__main__":
    run(main)
