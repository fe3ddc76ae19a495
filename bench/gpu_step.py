"""GPU throughput: GPT-2 training steps on the CuPy backend, and where one step's time goes.

    python bench/gpu_step.py [--model d12] [-b 64] [-t 1024] [--precision bf16] [--steps 10]

Prints ms/step, tok/s, MFU (llm.c's 6N + 6LCT flops per token, against 989 TFLOP/s dense bf16) and peak
GPU memory, then a table of one step's time per backend op, measured with CUDA events around each call.
"""
import argparse
import os
import statistics
import sys
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run from a checkout
from llm.backends import get_backend
from llm.comm import SingleComm
from llm.config import GPT2Config
from llm.model import GPT2, init_params
from llm.zero import ZeroOptimizer

PEAK_BF16 = 989e12
OPS = ("encoder_forward", "encoder_backward", "layernorm_forward", "layernorm_backward", "matmul_forward",
       "matmul_backward", "attention_forward", "attention_backward", "gelu_forward", "gelu_backward",
       "residual_forward", "fused_classifier", "adamw", "sumsq")


class OpTimer:
    """Wraps a backend's ops so that each call is bracketed by CUDA events; totals per op name."""

    def __init__(self, backend):
        import cupy
        self.cupy, self.backend, self.events, self.enabled = cupy, backend, [], False
        for name in OPS:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, op):
        def timed(*args, **kwargs):
            if not self.enabled:
                return op(*args, **kwargs)
            start, end = self.cupy.cuda.Event(), self.cupy.cuda.Event()
            start.record()
            out = op(*args, **kwargs)
            end.record()
            self.events.append((name, start, end))
            return out
        return timed

    def table(self):
        self.cupy.cuda.Device().synchronize()
        totals, counts = defaultdict(float), defaultdict(int)
        for name, start, end in self.events:
            totals[name] += self.cupy.cuda.get_elapsed_time(start, end)
            counts[name] += 1
        self.events.clear()
        return totals, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="d12")
    parser.add_argument("-b", type=int, default=64)
    parser.add_argument("-t", type=int, default=1024)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    import cupy

    config = GPT2Config.from_descriptor(args.model)
    backend = get_backend("cupy", args.precision)
    model = GPT2(config, backend)
    model.load_params(init_params(config))
    optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.0)
    timer = OpTimer(backend)
    B, T = args.b, args.t
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)
    y = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)

    def step(t):
        model.zero_grad()
        losses = model.forward(x, y, dloss=1.0 / (B * T))
        model.backward()
        norm = optimizer.grad_norm()
        optimizer.step(1e-4, t, 1.0 / norm if norm > 1 else 1.0)
        return losses

    for t in (1, 2):   # warm-up: compiles every kernel, fills the memory pool
        step(t)
    cupy.cuda.Device().synchronize()
    times = []
    for t in range(3, 3 + args.steps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        losses = step(t)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    ms = statistics.median(times)
    flops = (6 * config.num_parameters + 6 * config.num_layers * config.channels * T) * B * T
    pool = cupy.get_default_memory_pool()
    free, total = cupy.cuda.runtime.memGetInfo()
    print(f"{args.model} B={B} T={T} {args.precision} on {backend.device_name()}")
    print(f"loss {float(losses.mean()):.4f}  step times (ms): " + " ".join(f"{t:.1f}" for t in times))
    print(f"median {ms:.2f} ms/step | {B * T / ms * 1000:.0f} tok/s | MFU {100 * flops / (ms / 1000) / PEAK_BF16:.1f}% "
          f"of 989 TFLOP/s | memory: pool {pool.total_bytes() / 2**30:.2f} GiB, device used "
          f"{(total - free) / 2**30:.2f} GiB of {total / 2**30:.0f} GiB")

    timer.enabled = True
    step(3 + args.steps)
    timer.enabled = False
    totals, counts = timer.table()
    whole = sum(totals.values())
    print(f"\nper-op time of one step (CUDA events around each call; {whole:.2f} ms in ops):")
    print(f"{'op':<22}{'calls':>6}{'ms':>10}{'share':>8}")
    for name in sorted(totals, key=totals.get, reverse=True):
        print(f"{name:<22}{counts[name]:>6}{totals[name]:>10.2f}{100 * totals[name] / whole:>7.1f}%")


if __name__ == "__main__":
    main()
