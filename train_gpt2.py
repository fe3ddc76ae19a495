"""Train GPT-2, as llm.c's train_gpt2.cu: same flags, same printed lines, same files.

  python train_gpt2.py -e d12 -b 4 -t 64                   one process (CPU, or GPU with --backend cupy)
  mpirun -np 2 python train_gpt2.py -e d12 -z 1            two ranks, ZeRO stage 1

One step reads top to bottom in main(): data, forward, backward, reduce, clip, update, gather, log.
"""
import math
import os
import sys
import time
import traceback

import numpy as np

from llm import checkpoint, formats
from llm.backends import get_backend
from llm.comm import launched_world_size, make_comm
from llm.config import ConfigError, GPT2Config
from llm.data import DataError, DataLoader, EvalLoader, score
from llm.formats import FormatError
from llm.model import GPT2, init_params
from llm.optim import LRScheduler, OutlierDetector, clip_scale
from llm.sample import generate
from llm.tokenizer import TokenizerError, TokenizerFile
from llm.zero import ZeroOptimizer, padded_size

HELLASWAG_PATH = "data/hellaswag/hellaswag_val.bin"
TOKENIZER_PATH = "gpt2_tokenizer.bin"

# flag -> (default, type, meaning): llm.c's flags, defaults and meanings
FLAGS = {
    "-i": ("data/tinyshakespeare/tiny_shakespeare_train.bin", str, "train data glob pattern"),
    "-j": ("data/tinyshakespeare/tiny_shakespeare_val.bin", str, "val data glob pattern"),
    "-e": ("gpt2_124M_bf16.bin", str, "model .bin to load, or a descriptor: dL (d12) or dLcChNH (d2c64h4)"),
    "-o": (None, str, "output dir for main.log and checkpoints"),
    "-n": (0, int, "write a checkpoint every N steps (0: never)"),
    "-nk": (0, int, "checkpoints to keep, older are deleted (0: keep all)"),
    "-nm": (0, int, "steps that are multiples of this are never deleted (0: off)"),
    "-y": (0, int, "resume from the newest complete checkpoint in -o (0/1)"),
    "-b": (4, int, "micro batch size B per process"),
    "-t": (1024, int, "sequence length T"),
    "-d": (-1, int, "total batch size in tokens (-1: B*T*N, no accumulation)"),
    "-x": (-1, int, "max steps (-1: one epoch of the train data)"),
    "-k": ("cosine", str, "LR scheduler: cosine, linear, constant, wsd"),
    "-l": (3e-4, float, "learning rate"),
    "-u": (0, int, "warmup iterations"),
    "-q": (1.0, float, "final LR fraction"),
    "-c": (0.0, float, "weight decay"),
    "-sl": (0.0, float, "skip the update if the loss z-score exceeds this (0: off)"),
    "-sg": (0.0, float, "skip the update if the grad-norm z-score exceeds this (0: off)"),
    "-v": (20, int, "val loss every N steps"),
    "-m": (20, int, "val batches (-1: the whole val split)"),
    "-s": (20, int, "sample every N steps (0: never)"),
    "-g": (64, int, "tokens to generate"),
    "-h": (0, int, "HellaSwag eval (0/1), from " + HELLASWAG_PATH),
    "-a": (0, int, "overfit a single batch (0/1): train on the val data, no shuffle"),
    "-f": (1, int, "allow TF32 matmuls in fp32 on the GPU (0/1)"),
    "-w": (1, int, "keep fp32 master weights when the parameters are bf16 (0/1)"),
    "-z": (0, int, "ZeRO stage: 0 (off) or 1 (shard the optimizer state)"),
    "-r": (1, int, "recompute (llm.c: 0 none, 1 GELU, 2 GELU+LN); here every activation is kept"),
    "--backend": ("auto", str, "numpy, cupy, or auto (cupy when a GPU is usable)"),
    "--precision": ("auto", str, "fp32 or bf16 (auto: bf16 on the GPU, fp32 on the CPU)"),
    "--comm": ("auto", str, "auto, or nccl: NCCL between GPUs even for a single rank"),
}


class UsageError(ValueError):
    pass


def usage():
    lines = ["Usage: python train_gpt2.py [options]   (options come in pairs: -flag value)"]
    lines += [f"  {flag:<11} {meaning} (default {default})" for flag, (default, _, meaning) in FLAGS.items()]
    return "\n".join(lines)


def parse_args(argv):
    args = {flag: default for flag, (default, _, _) in FLAGS.items()}
    if len(argv) % 2:
        raise UsageError(f"flag {argv[-1]} has no value (options come in pairs: -flag value)")
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag not in FLAGS:
            raise UsageError(f"unknown flag {flag}")
        kind = FLAGS[flag][1]
        try:
            args[flag] = kind(value)
        except ValueError:
            raise UsageError(f"flag {flag} needs {kind.__name__} value, got '{value}'") from None
    return {flag.lstrip("-"): value for flag, value in args.items()}


# ---- printing in llm.c's table style ----
def row(name, value):
    return f"| {name:<21} | {value:<50} |"


BORDER = "+" + "-" * 23 + "+" + "-" * 52 + "+"


def wide_row(text):
    return f"| {text:<74} |"


def choose_backend(args):
    name, precision = args["backend"], args["precision"]
    if name == "auto":
        try:
            import cupy
            name = "cupy" if cupy.cuda.runtime.getDeviceCount() > 0 else "numpy"
        except Exception:
            name = "numpy"
    if precision == "auto":
        precision = "bf16" if name == "cupy" else "fp32"
    if name not in ("numpy", "cupy"):
        raise UsageError(f"--backend must be numpy, cupy or auto, not '{name}'")
    if precision not in ("fp32", "bf16"):
        raise UsageError(f"--precision must be fp32 or bf16, not '{precision}'")
    if name == "numpy" and precision != "fp32":
        raise UsageError("the numpy backend computes in fp32 only: use --precision fp32 or --backend cupy")
    return name, precision


def peak_flops(backend):
    """Dense peak FLOP/s of the device for MFU, or None where unknown (the CPU, unlisted GPUs)."""
    if backend.name != "cupy":
        return None
    name = backend.device_name()
    table = {"H100": 989e12, "H200": 989e12, "A100": 312e12}   # dense bf16 with fp32 accumulate
    for key, bf16 in table.items():
        if key in name:
            return bf16 if backend.precision == "bf16" else bf16 / 2   # fp32 runs on TF32 units
    return None


def build_model(args, backend, comm):
    """The model from a checkpoint file or a descriptor, with buffers padded for ZeRO."""
    source = args["e"]
    if source.endswith(".bin"):
        config, params, _ = formats.read_model(source)
    else:
        config = GPT2Config.from_descriptor(source)
        params = init_params(config)
    model = GPT2(config, backend, padded_size(config.num_parameters, comm.world_size, args["z"]))
    model.load_params(params)
    return model


def main(argv):
    args = parse_args(argv)
    backend_name, precision = choose_backend(args)
    if args["comm"] not in ("auto", "nccl") or args["comm"] == "nccl" and backend_name != "cupy":
        raise UsageError(f"--comm {args['comm']}: use auto, or nccl with the cupy backend")
    comm = make_comm(gpu=backend_name == "cupy", force_nccl=args["comm"] == "nccl")
    backend = get_backend(backend_name, precision, master_weights=bool(args["w"]), allow_tf32=bool(args["f"]))
    log0 = print if comm.rank == 0 else (lambda *a, **k: None)
    B, T, N = args["b"], args["t"], comm.world_size
    if args["z"] not in (0, 1):
        raise UsageError(f"-z {args['z']}: only ZeRO stages 0 and 1 exist here")
    if args["v"] <= 0:
        raise UsageError("-v must be positive (val loss every N steps)")
    if args["r"] != 1:
        log0(f"note: -r {args['r']} has no effect: this trainer keeps every activation, it never recomputes")
    if args["f"] != 1 and not (backend.name == "cupy" and backend.precision == "fp32"):
        log0(f"note: -f {args['f']} has no effect: TF32 applies to fp32 matmuls on the GPU only")

    model = build_model(args, backend, comm)
    config = model.config
    if T > config.max_seq_len:
        raise UsageError(f"-t {T} exceeds the model's max_seq_len {config.max_seq_len}")
    total_batch = args["d"] if args["d"] > 0 else B * T * N
    if total_batch % (B * T * N):
        raise UsageError(f"total batch size -d {total_batch} is not divisible by B*T*N = {B}*{T}*{N} = {B * T * N}")
    grad_accum = total_batch // (B * T * N)

    train_pattern = args["j"] if args["a"] else args["i"]
    train_loader = DataLoader(train_pattern, B, T, comm.rank, N, shuffle=not args["a"], vocab_size=config.vocab_size)
    val_loader = DataLoader(args["j"], B, T, comm.rank, N, shuffle=False, vocab_size=config.vocab_size)
    train_steps = args["x"] if args["x"] > 0 else train_loader.tokens_per_epoch // total_batch
    val_steps = args["m"] if args["m"] > 0 else val_loader.num_samples // (B * N)
    run_hellaswag = bool(args["h"]) and os.path.exists(HELLASWAG_PATH)
    eval_loader = EvalLoader(HELLASWAG_PATH, B, T, comm.rank, N) if run_hellaswag else None

    # ---- the configuration, as llm.c prints it ----
    log0(BORDER + "\n" + row("Parameter", "Value") + "\n" + BORDER)
    for name, value in [
            ("train data pattern", train_pattern), ("val data pattern", args["j"]),
            ("output log dir", args["o"] or "NULL"), ("checkpoint_every", args["n"]), ("resume", args["y"]),
            ("micro batch size B", B), ("sequence length T", T), ("total batch size", total_batch),
            ("LR scheduler", args["k"]), ("learning rate (LR)", f"{args['l']:e}"),
            ("warmup iterations", args["u"]), ("final LR fraction", f"{args['q']:e}"),
            ("weight decay", f"{args['c']:e}"), ("skip update lossz", f"{args['sl']:f}"),
            ("skip update gradz", f"{args['sg']:f}"), ("max_steps", args["x"]), ("val_loss_every", args["v"]),
            ("val_max_steps", args["m"]), ("sample_every", args["s"]), ("genT", args["g"]),
            ("overfit_single_batch", args["a"]),
            ("use_master_weights", "enabled" if backend.master_weights else "disabled"),
            ("recompute", 0)]:
        log0(row(name, value))
    peak = peak_flops(backend)
    log0(BORDER + "\n" + row("device", backend.device_name()) + "\n" +
         row("peak TFlops", f"{peak / 1e12 if peak else -1.0:.1f}") + "\n" +
         row("precision", backend.precision.upper()) + "\n" + BORDER)
    for name, value in [("weight init method", args["e"] if args["e"].endswith(".bin") else f"random ({args['e']})"),
                        ("max_sequence_length T", config.max_seq_len), ("vocab_size V", config.vocab_size),
                        ("padded_vocab_size Vp", config.padded_vocab_size), ("num_layers L", config.num_layers),
                        ("num_heads NH", config.num_heads), ("channels C", config.channels),
                        ("num_parameters", config.num_parameters)]:
        log0(row(name, value))
    log0(BORDER + "\n" + row("train_num_batches", train_steps) + "\n" + row("val_num_batches", val_steps))
    log0(BORDER + "\n" + row("run hellaswag", "yes" if run_hellaswag else "no") + "\n" + BORDER)
    log0(wide_row("Zero Stage1 is enabled" if args["z"] == 1 else "Zero Optimization is disabled"))
    log0(row("num_processes", N) + "\n" + row("zero_stage", args["z"]) + "\n" + row("communicator", comm.name)
         + "\n" + BORDER)
    if args["h"] and not run_hellaswag:
        log0(f"HellaSwag eval not found at {HELLASWAG_PATH}, skipping its evaluation")
        log0("You can run `python data/hellaswag.py` to export and use it with `-h 1`.")

    optimizer = ZeroOptimizer(model, comm, args["z"], args["c"])
    param_bytes = config.num_parameters * np.dtype(backend.dtype).itemsize
    log0(f"num_parameters: {config.num_parameters} => bytes: {param_bytes}")
    log0(f"allocated {param_bytes >> 20} MiB for model parameters")
    log0(f"batch_size B={B} * seq_len T={T} * num_processes={N} and total_batch_size={total_batch}")
    log0(f"=> setting grad_accum_steps={grad_accum}")
    log0(f"allocated {param_bytes >> 20} MiB for parameter gradients")
    log0(f"allocated {model.activations(B, T).nbytes >> 20} MiB for activations")
    log0(f"allocated {optimizer.m.nbytes >> 20} MiB for AdamW optimizer state m")
    log0(f"allocated {optimizer.v.nbytes >> 20} MiB for AdamW optimizer state v")
    if optimizer.master is not None:
        log0(f"allocated {optimizer.master.nbytes >> 20} MiB for master copy of params")

    tokenizer = TokenizerFile(TOKENIZER_PATH) if os.path.exists(TOKENIZER_PATH) else None
    if tokenizer is None:
        log0(f"WARNING: {TOKENIZER_PATH} not found: samples print as token ids "
             "(python data/tinyshakespeare.py writes it)")

    # ---- logging and resuming ----
    out_dir, log_path = args["o"], None
    start_step = 0
    if out_dir:
        if comm.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        comm.barrier()
        log_path = os.path.join(out_dir, "main.log")
        if comm.rank == 0 and not args["y"]:
            open(log_path, "w").close()
    if args["y"] and out_dir:
        resume_step = checkpoint.latest_step(out_dir)
        if resume_step is not None:
            start_step = checkpoint.load(out_dir, resume_step, model, optimizer, train_loader)
            log0(f"resuming from checkpoint at step {start_step} in {out_dir}")

    def log(line):
        if log_path and comm.rank == 0:
            with open(log_path, "a") as f:
                f.write(line + "\n")

    scheduler = LRScheduler(args["k"], args["l"], args["u"], train_steps, args["q"])
    loss_outliers, norm_outliers = OutlierDetector(), OutlierDetector()
    flops_per_step = (6 * config.num_parameters + 6 * config.num_layers * config.channels * T) * B * T * grad_accum
    ema_tok_s, total_ms = 0.0, 0.0

    for step in range(start_step, train_steps + 1):
        last_step = step == train_steps

        # ---- validation, eval and sampling ----
        if step % args["v"] == 0 or last_step:
            val_loader.reset()
            val_loss = 0.0
            for _ in range(val_steps):
                x, y = val_loader.next_batch()
                val_loss += float(model.forward(x, y).mean())
            val_loss = comm.scalar_avg(val_loss / val_steps)
            log0(f"val loss {val_loss:f}")
            log(f"s:{step} tel:{val_loss:.4f}")
        if eval_loader is not None and (step > 0 and step % args["v"] == 0 or last_step):
            correct = 0
            for x, y, mask, labels, n_active in eval_loader:
                losses = backend.to_numpy(model.forward(x, y))
                correct += score(losses, mask, labels, n_active)
            correct = comm.scalar_sum(correct)
            accuracy = correct / eval_loader.num_examples
            log0(f"HellaSwag: {int(correct)}/{eval_loader.num_examples} = {accuracy:f}")
            log(f"s:{step} eval:{accuracy:.4f}")
        if comm.rank == 0 and args["s"] > 0 and (step > 0 and step % args["s"] == 0 or last_step):
            tokens = generate(model, eot=formats.GPT2_EOT, gen_tokens=args["g"], max_T=T)
            text = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
            print(f"generating:\n---\n{text}\n---")

        # ---- checkpoint ----
        # (never at the step a run starts or resumes from: that state is already on disk or trivial)
        if out_dir and args["n"] > 0 and step > start_step and (step % args["n"] == 0 or last_step):
            log0(f"Writing checkpoint at step {step}")
            checkpoint.save(out_dir, step, model, optimizer, train_loader, comm)
            old = step - args["nk"] * args["n"]
            if comm.rank == 0 and args["nk"] > 0 and old > 0 and (args["nm"] == 0 or old % args["nm"]):
                checkpoint.delete(out_dir, old)
        if last_step:
            break

        # ---- one training step: micro-steps, reduce, clip, update, gather ----
        t0 = time.perf_counter()
        model.zero_grad()
        if args["a"]:
            train_loader.reset()   # overfit a single batch: the same batch every step
        loss_sum = 0.0
        for _ in range(grad_accum):
            x, y = train_loader.next_batch()
            losses = model.forward(x, y, dloss=1.0 / (B * T * grad_accum))
            loss_sum = loss_sum + losses.sum()   # stays on the device until the one sync below
            model.backward()
        loss = comm.scalar_avg(float(loss_sum)) / (B * T * grad_accum)
        optimizer.reduce_gradients()
        grad_norm = optimizer.grad_norm()
        lr = scheduler(step)
        loss_z, norm_z = loss_outliers.update(loss), norm_outliers.update(grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            log0(f"skipping update: non-finite loss {loss} or grad norm {grad_norm}")
        elif args["sl"] and loss_z > args["sl"]:
            log0(f"skipping update due to loss z-score of {loss_z:f}")
        elif args["sg"] and norm_z > args["sg"]:
            log0(f"skipping update due to grad z-score of {norm_z:f}")
        else:
            optimizer.step(lr, step + 1, clip_scale(grad_norm))
        backend.synchronize()
        ms = (time.perf_counter() - t0) * 1000

        tok_s = total_batch / ms * 1000   # an EMA from the second step on, bias-corrected, as llm.c
        if step > start_step:
            ema_tok_s = 0.95 * ema_tok_s + 0.05 * tok_s
            tok_s = ema_tok_s / (1 - 0.95 ** (step - start_step))
        mfu = flops_per_step / (ms / 1000) / peak if peak else -1.0
        if step > start_step:
            total_ms += ms
        log0(f"step {step + 1:4d}/{train_steps} | loss {loss:7.6f} ({loss_z:+.2f}z)| norm {grad_norm:6.4f} "
             f"({norm_z:+.2f}z)| lr {lr:.2e} | {ms:.2f} ms | {100 * mfu:.1f}% {backend.precision} MFU | "
             f"{tok_s:.0f} tok/s")
        log(f"s:{step} trl:{loss:.4f} lr:{lr:.6f} norm:{grad_norm:.2f}")

    if train_steps - start_step > 1:
        log0(f"total average iteration time: {total_ms / (train_steps - start_step - 1):f} ms")


def fail(message):
    """Report an error and stop every rank: under mpirun a rank that just exits leaves the others waiting
    in their next collective, so a multi-process run aborts the whole job."""
    world_size = launched_world_size()
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    print(message if world_size == 1 else f"rank {rank}: {message}", file=sys.stderr, flush=True)
    if world_size > 1:
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
    sys.exit(1)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv in (["--help"], ["-help"]):
        print(usage())
        sys.exit(0)
    try:
        main(argv)
    except UsageError as e:
        fail(f"error: {e}\n{usage()}")
    except (ConfigError, FormatError, DataError, TokenizerError, ValueError) as e:
        fail(f"error: {e}")
    except Exception:
        fail(traceback.format_exc())
