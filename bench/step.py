"""Training speed: llm/step.py's train_step (forward, backward, norm, clip, AdamW) on either backend, and
where one step's time goes.

    python -m bench.step --backend numpy            GPT-2 124M, B=4, T=64 on the CPU
    python -m bench.step --backend cupy             GPT-2 124M, B=64, T=1024, bf16 on the GPU
    options: --model d12 -b B -t T --precision bf16|fp32 --steps 6 -r 1 --attention auto|cudnn
             --cuda-graph 1|0

Prints each step's time (until its loss and norm are read, as the trainer times it) and their median, then
the time of all the timed steps in a row over their number (`6 steps in a row: 1234.5 ms/step`, what
bench/table.py reads, and how bench/torch_gpt2.py times torch's), with tok/s and MFU (llm.c's FLOPs per
token against the device's peak, where known), memory on the GPU (the pool, and the peak that nvidia-smi
saw while the steps ran) and the SM clock and power it saw, then a table of one step's time per backend op
(that step runs without CUDA graphs, so that each op can be timed on its own).
"""
import contextlib
import statistics
import time
from collections import defaultdict

import numpy as np

from bench import check_length
from bench.gpu_sampler import GpuSampler
from llm import memory
from llm.backends import get_backend
from llm.comm import SingleComm
from llm.config import GPT2Config
from llm.launch import Parser, positive_int, run
from llm.model import GPT2
from llm.outliers import UpdateGuard
from llm.step import train_step
from llm.weight_init import init_params
from llm.zero import ZeroOptimizer

OPS = ("encoder_forward", "encoder_backward", "layernorm_forward", "residual_layernorm_forward",
       "layernorm_backward", "matmul_forward", "matmul_backward", "matmul_gelu_forward",
       "matmul_gelu_backward", "attention_forward", "attention_backward", "gelu_forward", "fused_classifier",
       "adamw", "sumsq")
DEFAULT_BT = {"numpy": (4, 64), "cupy": (64, 1024)}
ADVICE = "lower -b, use -r 2, or a smaller --model"   # when a step does not fit


class OpTimer:
    """Wraps a backend's ops so that each call is timed (CUDA events on the GPU, the clock on the CPU,
    where every op finishes before it returns); totals per op name. An op that calls others (NumPy's
    matmul_gelu_forward calls matmul_forward and gelu_forward) is timed as itself alone, so that no time
    counts twice."""

    def __init__(self, backend):
        self.backend, self.records, self.enabled, self.inside = backend, [], False, False
        for name in OPS:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, op):
        gpu = self.backend.name == "cupy"

        def timed(*args, **kwargs):
            if not self.enabled or self.inside:
                return op(*args, **kwargs)
            start = self.backend.xp.cuda.Event() if gpu else time.perf_counter()
            if gpu:
                start.record()
            self.inside = True
            out = op(*args, **kwargs)
            self.inside = False
            if gpu:
                end = self.backend.xp.cuda.Event()
                end.record()
            else:
                end = time.perf_counter()
            self.records.append((name, start, end))
            return out
        return timed

    def table(self):
        self.backend.synchronize()
        totals, counts = defaultdict(float), defaultdict(int)
        for name, start, end in self.records:
            gpu = not isinstance(start, float)
            totals[name] += self.backend.xp.cuda.get_elapsed_time(start, end) if gpu else (end - start) * 1000
            counts[name] += 1
        self.records.clear()
        whole = sum(totals.values())
        width = max(map(len, OPS)) + 2
        lines = [f"per-op time of one step ({whole:.2f} ms in ops):",
                 f"{'op':<{width}}{'calls':>6}{'ms':>10}{'share':>8}"]
        for name in sorted(totals, key=totals.get, reverse=True):
            share = 100 * totals[name] / whole
            lines.append(f"{name:<{width}}{counts[name]:>6}{totals[name]:>10.2f}{share:>7.1f}%")
        return "\n".join(lines)


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--model", default="d12")
    parser.add_argument("-b", type=positive_int, help="micro batch size (default 4 on numpy, 64 on cupy)")
    parser.add_argument("-t", type=positive_int, help="sequence length (default 64 on numpy, 1024 on cupy)")
    parser.add_argument("--steps", type=positive_int, default=6, help="timed steps, after two warm-up steps")
    parser.add_argument("-r", type=int, default=1, choices=[0, 1, 2],
                        help="recompute: 0 none, 1 GELU, 2 GELU and layernorms")
    parser.add_argument("--attention", default="auto", choices=["auto", "cudnn"])
    parser.add_argument("--cuda-graph", type=int, default=1, choices=[0, 1],
                        help="replay the forward and backward as CUDA graphs (cupy in bf16), as training "
                             "does")
    args = parser.parse_args(argv)
    backend = get_backend(args.backend, args.precision, attention=args.attention,
                          cuda_graph=bool(args.cuda_graph))
    B, T = args.b or DEFAULT_BT[backend.name][0], args.t or DEFAULT_BT[backend.name][1]
    config = GPT2Config.from_descriptor(args.model)
    check_length(parser, args.model, config, T)
    memory.check(memory.needed(backend, config, [(B, T)], args.r), backend.memory_available(), ADVICE)
    bench(args, backend, config, B, T)


def bench(args, backend, config, B, T):
    gpu = backend.name == "cupy"
    model = GPT2(config, backend, recompute=args.r)
    if config.num_parameters < 400_000_000:
        model.load_params(init_params(config))
    else:   # llm.c's init would take minutes on the host; the timing does not depend on the values
        model.load_params(np.random.default_rng(0).standard_normal(config.num_parameters, np.float32) * 0.02)
    optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.0)
    guard = UpdateGuard()
    timer = OpTimer(backend)
    rng = np.random.default_rng(0)
    batch = [(rng.integers(0, config.vocab_size, (B, T), dtype=np.int32),
              rng.integers(0, config.vocab_size, (B, T), dtype=np.int32))]

    def step(t):
        # as the trainer times a step: until its loss and norm are read, its update running on into the
        # next step's time, so that steps in a row count each update once
        t0 = time.perf_counter()
        result = train_step(model, optimizer, batch, 1e-4, t, guard)
        return result, (time.perf_counter() - t0) * 1000

    print(f"{args.model} B={B} T={T} {backend.precision} -r {args.r} attention "
          f"{backend.attention.name if gpu else 'naive'}{' CUDA graphs' if backend.cuda_graph else ''} on "
          f"{backend.device_name()}: "
          f"activations {model.activations(B, T).nbytes / 2**20:,.0f} MiB")
    for t in (1, 2):   # warm-up: compiles every kernel, fills the memory pool, records the graphs
        print(f"warm-up step {t}: loss {step(t)[0].loss:.4f}")
    with GpuSampler(backend.xp.cuda.Device().pci_bus_id) if gpu else contextlib.nullcontext() as smi:
        backend.synchronize()
        start, times = time.perf_counter(), []
        for t in range(3, 3 + args.steps):
            result, ms = step(t)
            times.append(ms)
            print(f"step {t}: loss {result.loss:.4f} norm {result.grad_norm:.4f} {ms:.1f} ms")
        backend.synchronize()   # the last update
        ms = (time.perf_counter() - start) * 1000 / args.steps   # as bench/torch_gpt2.py times its steps
    flops = config.flops_per_token(T) * B * T
    peak_flops = backend.peak_flops()
    mfu = f"{100 * flops / (ms / 1000) / peak_flops:.1f}%" if peak_flops else "n/a"
    print(f"median {statistics.median(times):.1f} ms/step, {args.steps} steps in a row: {ms:.1f} ms/step | "
          f"{B * T / ms * 1000:.0f} tok/s | MFU {mfu}")
    if gpu:
        pool = backend.xp.get_default_memory_pool()
        print(f"memory: pool {pool.total_bytes() / 2**20:,.0f} MiB, peak in use by nvidia-smi "
              f"{smi.peak_mib if smi.peak_mib is not None else 'n/a'} MiB")
        print(smi.clock_line())
    timer.enabled, backend.cuda_graph = True, False
    step(3 + args.steps)
    timer.enabled = False
    print(timer.table())


if __name__ == "__main__":
    run(main, memory_advice=ADVICE)
