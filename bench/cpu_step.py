"""CPU speed: one training step (forward + backward + AdamW update) of GPT-2 124M, B=4, T=64, on NumPy.

    python bench/cpu_step.py [--steps 6] [--model d12]

Prints each step's time and, last, the median in the form `median 1234.5 ms`.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run from a checkout
from llm.backends import get_backend
from llm.comm import SingleComm
from llm.config import GPT2Config
from llm.model import GPT2, init_params
from llm.zero import ZeroOptimizer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="d12")
    parser.add_argument("-b", type=int, default=4)
    parser.add_argument("-t", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after one warm-up step")
    args = parser.parse_args()
    config = GPT2Config.from_descriptor(args.model)
    model = GPT2(config, get_backend("numpy"))
    model.load_params(init_params(config))
    optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.0)
    rng = np.random.default_rng(0)
    B, T = args.b, args.t
    times = []
    for step in range(args.steps + 1):
        x = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)
        y = rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)
        t0 = time.perf_counter()
        model.zero_grad()
        loss = float(model.forward(x, y, dloss=1.0 / (B * T)).mean())
        model.backward()
        optimizer.step(lr=1e-4, t=step + 1, grad_scale=1.0)
        ms = (time.perf_counter() - t0) * 1000
        print(f"step {step}: loss {loss:.4f} {ms:.1f} ms" + (" (warm-up)" if step == 0 else ""))
        if step > 0:
            times.append(ms)
    print(f"{args.model} B={B} T={T} numpy, {os.cpu_count()} cores")
    print(f"median {statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
