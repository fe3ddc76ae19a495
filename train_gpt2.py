"""Train GPT-2, as llm.c's train_gpt2.cu: same flags, same printed lines, same files.

  python train_gpt2.py -e d12 -b 4 -t 64                   one process (CPU, or GPU with --backend cupy)
  mpirun -np 2 python train_gpt2.py -e d12 -z 1            two ranks, ZeRO stage 1

main() reads top to bottom as llm.c's: build, print the configuration, then per step: validate, eval,
sample, checkpoint, and one training step (llm/step.py: forward, backward, reduce, norm, clip, update, gather).
"""
import os
import sys
import time
import traceback

from llm import checkpoint, formats, report
from llm.backends import get_backend, resolve
from llm.comm import launched_world_size, make_comm
from llm.config import GPT2_EOT, WEIGHTS_HINT, ConfigError, GPT2Config
from llm.data import DataError, DataLoader, EvalLoader, score
from llm.formats import FormatError
from llm.model import GPT2
from llm.outliers import UpdateGuard
from llm.sample import generate
from llm.schedulers import LRScheduler
from llm.step import train_step
from llm.tokenizer import TokenizerError, TokenizerFile
from llm.weight_init import init_params
from llm.zero import ZeroOptimizer

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
    "-r": (1, int, "recompute in the backward to save memory: 0 none, 1 GELU, 2 GELU and layernorms"),
    "--backend": ("auto", str, "numpy, cupy, or auto (cupy when a GPU is usable)"),
    "--precision": ("auto", str, "fp32 or bf16 (auto: bf16 on the GPU, fp32 on the CPU)"),
    "--comm": ("auto", str, "auto, or nccl: NCCL between GPUs even for a single rank"),
    "--attention": ("auto", str, "auto (flash attention written here), or cudnn: cuDNN's (pip install .[cudnn])"),
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
    args = {flag.lstrip("-"): value for flag, value in args.items()}
    if args["comm"] not in ("auto", "nccl"):
        raise UsageError(f"--comm {args['comm']}: use auto, or nccl with the cupy backend")
    if args["z"] not in (0, 1):
        raise UsageError(f"-z {args['z']}: only ZeRO stages 0 and 1 exist here")
    if args["v"] <= 0:
        raise UsageError("-v must be positive (val loss every N steps)")
    if args["r"] not in (0, 1, 2):
        raise UsageError(f"-r {args['r']}: recompute is 0 (none), 1 (GELU) or 2 (GELU and layernorms)")
    return args


def build_model(args, backend):
    """The model from a checkpoint file or a descriptor (llm.c's random init)."""
    source = args["e"]
    if source.endswith(".bin"):
        if not os.path.exists(source):
            raise FormatError(f"{source}: no such file: {WEIGHTS_HINT}; or train from scratch with -e d12")
        config, params, _ = formats.read_model(source)
    else:
        config = GPT2Config.from_descriptor(source)
        params = init_params(config)
    model = GPT2(config, backend, recompute=args["r"])
    model.load_params(params)
    return model


def val_loss(model, loader, steps, comm):
    """Mean loss over `steps` batches from the start of the val split, averaged over ranks."""
    loader.reset()
    total = 0.0
    for _ in range(steps):
        total += float(model.validate(*loader.next_batch()).mean())
    return comm.scalar_avg(total / steps)


def hellaswag_correct(model, loader, comm):
    """How many eval examples, over all ranks, have their lowest-loss completion as the right one."""
    correct = 0
    for inputs, targets, mask, labels, n_active in loader:
        correct += score(model.backend.to_numpy(model.validate(inputs, targets)), mask, labels, n_active)
    return int(comm.scalar_sum(correct))


def main(argv):
    args = parse_args(argv)
    backend_name, precision = resolve(args["backend"], args["precision"])
    if args["comm"] == "nccl" and backend_name != "cupy":
        raise UsageError("--comm nccl needs the cupy backend")
    comm = make_comm(gpu=backend_name == "cupy", force_nccl=args["comm"] == "nccl")
    backend = get_backend(backend_name, precision, allow_tf32=bool(args["f"]), attention=args["attention"])
    log0 = print if comm.rank == 0 else (lambda *a, **k: None)
    if args["f"] != 1 and not (backend.name == "cupy" and backend.precision == "fp32"):
        log0(f"note: -f {args['f']} has no effect: TF32 applies to fp32 matmuls on the GPU only")

    # ---- the model, the data and the optimizer ----
    model = build_model(args, backend)
    config = model.config
    B, T, N = args["b"], args["t"], comm.world_size
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
    optimizer = ZeroOptimizer(model, comm, args["z"], args["c"], master_weights=bool(args["w"]))
    run = dict(train_pattern=train_pattern, total_batch=total_batch, train_steps=train_steps, val_steps=val_steps,
               run_hellaswag=run_hellaswag, master_weights=optimizer.master is not None)
    log0(report.config_tables(args, run, model, backend, comm))
    if args["h"] and not run_hellaswag:
        log0(f"HellaSwag eval not found at {HELLASWAG_PATH}, skipping its evaluation")
        log0("You can run `python data/hellaswag.py` to export and use it with `-h 1`.")
    log0(report.allocation_lines(model, optimizer, B, T, total_batch, grad_accum, N))
    tokenizer = TokenizerFile(TOKENIZER_PATH) if os.path.exists(TOKENIZER_PATH) else None
    if tokenizer is None:
        log0(f"WARNING: {TOKENIZER_PATH} not found: samples print as token ids "
             "(python data/tinyshakespeare.py writes it)")

    # ---- logging and resuming ----
    out_dir, log_path, start_step = args["o"], None, 0
    if out_dir:
        if comm.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        comm.barrier()
        log_path = os.path.join(out_dir, "main.log")
        if comm.rank == 0 and not args["y"]:
            open(log_path, "w").close()
        resume_step = checkpoint.latest_step(out_dir) if args["y"] else None
        if resume_step is not None:
            start_step = checkpoint.load(out_dir, resume_step, model, optimizer, train_loader)
            log0(f"resuming from checkpoint at step {start_step} in {out_dir}")

    def log(line):
        if log_path and comm.rank == 0:
            with open(log_path, "a") as f:
                f.write(line + "\n")

    scheduler = LRScheduler(args["k"], args["l"], args["u"], train_steps, args["q"])
    guard = UpdateGuard(args["sl"], args["sg"])
    throughput = report.Throughput(total_batch, config.flops_per_token(T) * B * T * grad_accum, backend.peak_flops())

    for step in range(start_step, train_steps + 1):
        last_step = step == train_steps
        if step % args["v"] == 0 or last_step:
            loss = val_loss(model, val_loader, val_steps, comm)
            log0(f"val loss {loss:f}")
            log(f"s:{step} tel:{loss:.4f}")
        if eval_loader is not None and (step > 0 and step % args["v"] == 0 or last_step):
            correct = hellaswag_correct(model, eval_loader, comm)
            accuracy = correct / eval_loader.num_examples
            log0(f"HellaSwag: {correct}/{eval_loader.num_examples} = {accuracy:f}")
            log(f"s:{step} eval:{accuracy:.4f}")
        if comm.rank == 0 and args["s"] > 0 and (step > 0 and step % args["s"] == 0 or last_step):
            tokens = generate(model, eot=GPT2_EOT, gen_tokens=args["g"], max_T=T)
            text = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
            print(f"generating:\n---\n{text}\n---")
        # a checkpoint, but never at the step a run starts or resumes from: that state is on disk or trivial
        if out_dir and args["n"] > 0 and step > start_step and (step % args["n"] == 0 or last_step):
            log0(f"Writing checkpoint at step {step}")
            checkpoint.save(out_dir, step, model, optimizer, train_loader, comm)
            old = step - args["nk"] * args["n"]
            if comm.rank == 0 and args["nk"] > 0 and old > 0 and (args["nm"] == 0 or old % args["nm"]):
                checkpoint.delete(out_dir, old)
        if last_step:
            break

        t0 = time.perf_counter()
        if args["a"]:
            train_loader.reset()   # overfit a single batch: the same batch every step
        batches = [train_loader.next_batch() for _ in range(grad_accum)]
        lr = scheduler(step)
        result = train_step(model, optimizer, batches, lr, step + 1, guard)
        if result.skipped:
            log0(result.skipped)
        backend.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        tok_s, mfu = throughput.update(ms)
        log0(report.step_line(step, train_steps, result, lr, ms, mfu, tok_s, backend.precision))
        log(f"s:{step} trl:{result.loss:.4f} lr:{lr:.6f} norm:{result.grad_norm:.2f}")

    if throughput.average_ms() is not None:
        log0(f"total average iteration time: {throughput.average_ms():f} ms")


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
