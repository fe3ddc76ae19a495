"""Where one training step's GPU time goes, kernel by kernel: the CUDA kernels of a few d12 steps, as the
GPU's profiling interface (CUPTI) records them, through torch.profiler, which is the only thing this needs
torch for (never a dependency of the project). Unlike bench/step.py's per-op table, the steps run as
training runs them, CUDA graphs and all, and nothing is added between the kernels.

    python -m bench.kernels [--model d12] [-b 64] [-t 1024] [--steps 3] [--attention auto|cudnn]
    python -m bench.kernels --torch      the same for torch.compile's step (bench/torch_gpt2.py's model)

Prints the milliseconds of kernels a step, split into GEMMs, attention and the rest; the idle time between
kernels; the kernels that take the most time, with their calls a step; the largest idle gaps, by the
kernels around them; and the host's CUDA calls around the longest gap, to tell a late host from a GPU that
waits on something else.
"""
import collections
import time

import numpy as np

from bench import check_length, model_arguments, needs, needs_gpu, needs_torch_gpu
from bench.step import ADVICE
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

needs("torch")
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

GEMM = ("gemm", "nvjet", "xmma", "cutlass", "matmul")
ATTENTION = ("flash", "fmha", "attention", "sdpa")
GAPS = 8   # the largest idle gaps listed, summed by the pair of kernels around them
HOST_CALLS = 24   # the host's last CUDA calls listed around the longest gap


def kind(name):
    low = name.lower()
    if any(s in low for s in ATTENTION):
        return "attention"
    return "gemm" if any(s in low for s in GEMM) else "other"


def report(prof, steps, label, top):
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total, calls = collections.defaultdict(float), collections.Counter()
    for e in kernels:
        total[e.name] += e.device_time_total / 1000
        calls[e.name] += 1
    kinds = collections.defaultdict(float)
    for name, ms in total.items():
        kinds[kind(name)] += ms
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    idle, end, before = 0.0, spans[0][1], spans[0][2]
    gaps, gap_count = collections.defaultdict(float), collections.Counter()
    longest = (0.0, 0.0)   # the longest single gap, (from, to) in microseconds
    for start, stop, name in spans[1:]:
        if start > end:   # the GPU ran nothing from the end of `before` to the start of `name`
            idle += start - end
            gaps[(before[:40], name[:40])] += start - end
            gap_count[(before[:40], name[:40])] += 1
            longest = max(longest, (end, start), key=lambda gap: gap[1] - gap[0])
        if stop >= end:
            end, before = stop, name
    print(f"{label}: {sum(total.values()) / steps:.2f} ms of kernels a step (" +
          ", ".join(f"{k} {v / steps:.2f}" for k, v in sorted(kinds.items())) +
          f"); idle between them {idle / 1000 / steps:.2f} ms a step")
    for name in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"{total[name] / steps:9.3f} ms {calls[name] // steps:5d}x  {kind(name):<9} {name[:110]}")
    # how many gaps make each sum: one long wait (at the first step, say) reads differently from one a step
    print("where the GPU waits, a step (how many gaps in all: the kernel before them -> the kernel after):")
    for pair in sorted(gaps, key=gaps.get, reverse=True)[:GAPS]:
        print(f"{gaps[pair] / 1000 / steps:9.3f} ms {gap_count[pair]:4d}x  {pair[0]} -> {pair[1]}")
    # whether the host was late: its CUDA calls that ended in the 3 ms before the longest gap or ran during
    # it, on the kernels' clock (a copy or launch issued only near the gap's end means the GPU waited for the
    # host; a wait, such as cudaEventSynchronize, shows when the host woke)
    if not gaps:
        return
    gap_from, gap_to = longest
    calls_then = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CPU
                        and e.time_range.end >= gap_from - 3000 and e.time_range.start <= gap_to)
    print(f"the longest gap, {(gap_to - gap_from) / 1000:.3f} ms, and the host's CUDA calls around it "
          f"(start and end, ms from the gap's start)" if calls_then else
          "the profile holds no host calls to set beside the longest gap")
    for start, stop, name in calls_then[-HOST_CALLS:]:
        print(f"{(start - gap_from) / 1000:+9.3f} {(stop - gap_from) / 1000:+9.3f} ms  {name[:60]}")


def ours(args):
    needs_gpu()
    backend = get_backend("cupy", "bf16", attention=args.attention, cuda_graph=True)
    config = GPT2Config.from_descriptor(args.model)
    memory.check(memory.needed(backend, config, [(args.b, args.t)], 1), backend.memory_available(), ADVICE)
    model = GPT2(config, backend, recompute=1)
    model.load_params(init_params(config))
    optimizer = ZeroOptimizer(model, SingleComm(), zero_stage=0, weight_decay=0.0)
    guard, rng = UpdateGuard(), np.random.default_rng(0)
    batch = [tuple(rng.integers(0, config.vocab_size, (args.b, args.t), dtype=np.int32) for _ in range(2))]
    step = iter(range(1, 1_000_000))

    def run_steps(n):
        for _ in range(n):
            train_step(model, optimizer, batch, 1e-4, next(step), guard)
        backend.synchronize()
    return run_steps, f"this project, {args.model} B={args.b} T={args.t} attention {backend.attention.name}"


def theirs(args):
    from bench.torch_gpt2 import GPT
    config = GPT2Config.from_descriptor(args.model)
    torch.manual_seed(0)
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  fused=True)
    compiled = torch.compile(model)
    x, y = (torch.randint(0, config.vocab_size, (args.b, args.t), device="cuda") for _ in range(2))

    def run_steps(n):
        for _ in range(n):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)   # no wait between steps, as bench/torch_gpt2.py times them
        torch.cuda.synchronize()
    return run_steps, f"torch.compile, {args.model} B={args.b} T={args.t}"


def main(argv):
    parser = Parser(description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--steps", type=positive_int, default=3, help="profiled steps, after warm-up ones")
    parser.add_argument("--attention", default="auto", choices=["auto", "cudnn"])
    parser.add_argument("--torch", action="store_true", help="profile torch.compile's step instead")
    parser.add_argument("--top", type=positive_int, default=25, help="kernels to list")
    args = parser.parse_args(argv)
    check_length(parser, args.model, GPT2Config.from_descriptor(args.model), args.t)
    needs_torch_gpu(torch)   # the profiler records CUDA kernels through torch's CUDA build, for either step
    run_steps, label = (theirs if args.torch else ours)(args)
    run_steps(4)   # compiles, plans the GEMMs, records the graphs
    t0 = time.perf_counter()
    run_steps(args.steps)
    print(f"{label}: {(time.perf_counter() - t0) * 1000 / args.steps:.1f} ms a step without the profiler")
    # the host's side as well for ours, which has no torch ops to record: only its CUDA calls
    activities = [ProfilerActivity.CUDA] + ([] if args.torch else [ProfilerActivity.CPU])
    with profile(activities=activities):   # a first session, thrown away, pays the profiler's start-up
        run_steps(1)
    with profile(activities=activities) as prof:
        run_steps(args.steps)
    report(prof, args.steps, label, args.top)


if __name__ == "__main__":
    run(main, memory_advice=ADVICE)
