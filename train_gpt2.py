"""Train GPT-2, as llm.c's train_gpt2.cu: same flags, same printed lines, same files.

  python train_gpt2.py -e d12 -b 4 -t 64                   one process (CPU, or GPU with --backend cupy)
  mpirun -np 2 python train_gpt2.py -e d12 -z 1            two ranks, ZeRO stage 1

main() reads top to bottom as llm.c's: build, print the configuration, then per step: validate, eval,
sample, checkpoint, and one training step (llm/step.py: forward, backward, reduce, norm, clip, update, gather).
"""
import sys

from llm import launch

if __name__ == "__main__":   # (not when a test imports this file for parse_args)
    launch.configure_threads()         # before numpy loads: BLAS reads its thread count once, when it loads
    launch.install_signal_handlers()   # Ctrl-C and SIGTERM: one line, and every rank stops

import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402

from llm import formats, memory, report  # noqa: E402
from llm.backends import BackendError, get_backend, resolve  # noqa: E402
from llm.checkpoint import CheckpointError, OutputDir  # noqa: E402
from llm.comm import make_comm  # noqa: E402
from llm.config import WEIGHTS_HINT, ConfigError, GPT2Config  # noqa: E402
from llm.data import DataError, DataLoader, EvalLoader, score, shared_files_warning  # noqa: E402
from llm.formats import FormatError  # noqa: E402
from llm.model import GPT2  # noqa: E402
from llm.outliers import DivergedError, UpdateGuard  # noqa: E402
from llm.sample import generate, generate_shapes  # noqa: E402
from llm.schedulers import SCHEDULERS, LRScheduler  # noqa: E402
from llm.step import train_step  # noqa: E402
from llm.tokenizer import TokenizerError, TokenizerFile  # noqa: E402
from llm.weight_init import init_params  # noqa: E402
from llm.zero import ZeroOptimizer, padded_size  # noqa: E402

HELLASWAG_PATH = "data/hellaswag/hellaswag_val.bin"
TOKENIZER_PATH = "gpt2_tokenizer.bin"


def one_of(*choices):
    return lambda v: v in choices, "one of " + ", ".join(map(str, choices))


# what a flag's value must be: (test, how to say it)
ANY = (lambda v: True, "")
POSITIVE = (lambda v: v > 0, "positive")
AT_LEAST_0 = (lambda v: v >= 0, "0 or more")
POSITIVE_OR_ALL = (lambda v: v > 0 or v == -1, "positive, or -1")
FRACTION = (lambda v: 0 <= v <= 1, "between 0 and 1")
ZERO_ONE = one_of(0, 1)

# flag -> (default, type, allowed values, meaning): llm.c's flags, defaults and meanings, then ours
FLAGS = {
    "-i": ("data/tinyshakespeare/tiny_shakespeare_train.bin", str, ANY, "train data glob pattern"),
    "-j": ("data/tinyshakespeare/tiny_shakespeare_val.bin", str, ANY, "val data glob pattern"),
    "-e": ("gpt2_124M_bf16.bin", str, ANY, "model .bin to load, or a descriptor: dL (d12) or dLcChNH (d2c64h4)"),
    "-o": (None, str, ANY, "output dir for main.log and checkpoints"),
    "-n": (0, int, AT_LEAST_0, "write a checkpoint every N steps (0: never)"),
    "-nk": (0, int, AT_LEAST_0, "checkpoints to keep, older are deleted (0: keep all)"),
    "-nm": (0, int, AT_LEAST_0, "steps that are multiples of this are never deleted (0: off)"),
    "-y": (0, int, ZERO_ONE, "resume from the newest complete checkpoint in -o (0/1)"),
    "-b": (4, int, POSITIVE, "micro batch size B per process"),
    "-t": (1024, int, POSITIVE, "sequence length T"),
    "-d": (-1, int, POSITIVE_OR_ALL, "total batch size in tokens (-1: B*T*N, no accumulation)"),
    "-x": (-1, int, POSITIVE_OR_ALL, "max steps (-1: one epoch of the train data)"),
    "-k": ("cosine", str, one_of(*SCHEDULERS), "LR scheduler: cosine, linear, constant, wsd"),
    "-l": (3e-4, float, AT_LEAST_0, "learning rate"),
    "-u": (0, int, AT_LEAST_0, "warmup iterations"),
    "-q": (1.0, float, FRACTION, "final LR fraction"),
    "-c": (0.0, float, AT_LEAST_0, "weight decay"),
    "-sl": (0.0, float, AT_LEAST_0, "skip the update if the loss z-score exceeds this (0: off)"),
    "-sg": (0.0, float, AT_LEAST_0, "skip the update if the grad-norm z-score exceeds this (0: off)"),
    "-v": (20, int, POSITIVE, "val loss every N steps"),
    "-m": (20, int, POSITIVE_OR_ALL, "val batches (-1: the whole val split)"),
    "-s": (20, int, AT_LEAST_0, "sample every N steps (0: never)"),
    "-g": (64, int, AT_LEAST_0, "tokens to generate"),
    "-h": (0, int, ZERO_ONE, "HellaSwag eval (0/1), from " + HELLASWAG_PATH),
    "-a": (0, int, ZERO_ONE, "overfit a single batch (0/1): train on the val data, no shuffle"),
    "-f": (1, int, ZERO_ONE, "allow TF32 matmuls in fp32 on the GPU (0/1)"),
    "-w": (1, int, ZERO_ONE, "keep fp32 master weights when the parameters are bf16 (0/1)"),
    "-z": (0, int, one_of(0, 1), "ZeRO stage: 0 (off) or 1 (shard the optimizer state)"),
    "-r": (1, int, one_of(0, 1, 2), "recompute in the backward to save memory: 0 none, 1 GELU, 2 GELU and layernorms"),
    "--backend": ("auto", str, one_of("auto", "numpy", "cupy"), "numpy, cupy, or auto (cupy when a GPU is usable)"),
    "--precision": ("auto", str, one_of("auto", "fp32", "bf16"),
                    "fp32 or bf16 (auto: bf16 on the GPU, fp32 on the CPU)"),
    "--comm": ("auto", str, one_of("auto", "nccl"), "auto, or nccl: NCCL between GPUs even for a single rank"),
    "--attention": ("auto", str, one_of("auto", "cudnn"),
                    "auto (flash attention written here), or cudnn: cuDNN's (pip install .[cudnn])"),
    "--cuda-graph": (1, int, ZERO_ONE, "replay each forward and backward as a recorded CUDA graph (0/1; "
                                       "the cupy backend in bf16)"),
    "--max-nonfinite": (5, int, AT_LEAST_0, "stop after this many steps in a row with a non-finite loss or "
                                            "grad norm (0: never)"),
}


class UsageError(ValueError):
    pass


def usage():
    lines = ["Usage: python train_gpt2.py [options]   (options come in pairs: -flag value)"]
    lines += [f"  {flag:<15} {meaning} (default {default})" for flag, (default, _, _, meaning) in FLAGS.items()]
    return "\n".join(lines)


def parse_args(argv):
    """-> {flag without its dashes: value}; UsageError (one line) for an unknown flag or a value it cannot take."""
    args = {flag: default for flag, (default, _, _, _) in FLAGS.items()}
    if len(argv) % 2:
        raise UsageError(f"flag {argv[-1]} has no value (options come in pairs: -flag value)")
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag not in FLAGS:
            raise UsageError(f"unknown flag {flag}")
        _, kind, (allowed, what), meaning = FLAGS[flag]
        try:
            args[flag] = kind(value)
        except ValueError:
            raise UsageError(f"flag {flag} needs {kind.__name__} value, got '{value}'") from None
        if kind is float and not math.isfinite(args[flag]):
            raise UsageError(f"{flag} {value}: must be a finite number ({meaning})")
        if not allowed(args[flag]):   # a list of choices says it all; a range is said with the flag's meaning
            raise UsageError(f"{flag} {value}: must be {what}" + ("" if what.startswith("one of") else f" ({meaning})"))
    args = {flag.lstrip("-"): value for flag, value in args.items()}
    for flag in ("n", "y"):
        if args[flag] and not args["o"]:
            raise UsageError(f"-{flag} {args[flag]} needs -o, the directory that holds the checkpoints")
    return args


def build_model(args, backend, comm):
    """The model from a checkpoint file or a descriptor (llm.c's random init), its flat buffers sized for
    the ZeRO stage's shards; refused in one line, before its parameters are read or drawn, where the run
    would need more memory than there is."""
    source = args["e"]
    if source.endswith(".bin"):
        if not os.path.exists(source):
            raise FormatError(f"{source}: no such file: {WEIGHTS_HINT}; or train from scratch with -e d12")
        config = formats.read_model_config(source)
    else:
        config = GPT2Config.from_descriptor(source)
    B, T = args["b"], args["t"]
    if T > config.max_seq_len:
        raise UsageError(f"-t {T} exceeds the model's max_seq_len {config.max_seq_len}")
    shapes = [(B, T)] + (generate_shapes(config, args["g"], T) if args["s"] and comm.rank == 0 else [])
    memory.check(memory.needed(backend, config, shapes, args["r"], zero_stage=args["z"],
                               world_size=comm.world_size, master_weights=bool(args["w"]),
                               checkpoints=bool(args["n"] or args["y"])), backend.memory_available())
    params = formats.read_model(source)[1] if source.endswith(".bin") else init_params(config)
    flat_size = padded_size(config.num_parameters, comm.world_size, args["z"])
    model = GPT2(config, backend, recompute=args["r"], flat_size=flat_size)
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


def sample_decoder(args, config, log0):
    """The tokenizer file that decodes samples, checked against the model's vocab now rather than at the
    first sample; None when no samples are drawn or the file is missing (samples then print as ids)."""
    if args["s"] == 0:
        return None
    if not os.path.exists(TOKENIZER_PATH):
        log0(f"WARNING: {TOKENIZER_PATH} not found: samples print as token ids "
             "(python data/tinyshakespeare.py writes it)")
        return None
    return TokenizerFile(TOKENIZER_PATH, expected_vocab=config.vocab_size)


def main(argv):
    args = parse_args(argv)
    backend_name, precision = resolve(args["backend"], args["precision"])
    if args["comm"] == "nccl" and backend_name != "cupy":
        raise UsageError("--comm nccl needs the cupy backend")
    comm = make_comm(gpu=backend_name == "cupy", force_nccl=args["comm"] == "nccl")
    backend = get_backend(backend_name, precision, allow_tf32=bool(args["f"]), attention=args["attention"],
                          cuda_graph=bool(args["cuda-graph"]))
    log0 = print if comm.rank == 0 else (lambda *a, **k: None)
    if args["f"] != 1 and not (backend.name == "cupy" and backend.precision == "fp32"):
        log0(f"note: -f {args['f']} has no effect: TF32 applies to fp32 matmuls on the GPU only")
    out = OutputDir(args["o"], resume=args["y"], comm=comm)   # locked for this run, checked, tidied
    np.seterr(all="ignore")   # a non-finite loss or norm is the guard's to report, in one line a step

    # ---- the model, the data and the optimizer ----
    model = build_model(args, backend, comm)
    config = model.config
    B, T, N = args["b"], args["t"], comm.world_size
    total_batch = args["d"] if args["d"] > 0 else B * T * N
    if total_batch % (B * T * N):
        raise UsageError(f"total batch size -d {total_batch} is not divisible by B*T*N = {B}*{T}*{N} = {B * T * N}")
    grad_accum = total_batch // (B * T * N)
    train_pattern = args["j"] if args["a"] else args["i"]
    train_loader = DataLoader(train_pattern, B, T, comm.rank, N, shuffle=not args["a"], vocab_size=config.vocab_size)
    val_loader = DataLoader(args["j"], B, T, comm.rank, N, shuffle=False, vocab_size=config.vocab_size)
    if not args["a"] and (warning := shared_files_warning(train_loader, val_loader)):   # -a 1 trains on -j
        log0(warning)
    train_steps = args["x"] if args["x"] > 0 else train_loader.tokens_per_epoch // total_batch
    if train_steps == 0:
        raise UsageError(f"one epoch of '{train_pattern}' ({train_loader.tokens_per_epoch} tokens) is less than one "
                         f"step's total batch of {total_batch}: use a smaller -d, or -x")
    val_batches = val_loader.num_samples // (B * N)   # the whole val split; -m never reads a batch twice
    val_steps = min(args["m"], val_batches) if args["m"] > 0 else val_batches
    tokenizer = sample_decoder(args, config, log0)
    eot = tokenizer.eot if tokenizer else config.eot
    run_hellaswag = bool(args["h"]) and os.path.exists(HELLASWAG_PATH)
    eval_loader = EvalLoader(HELLASWAG_PATH, B, T, comm.rank, N, config.vocab_size, eot) if run_hellaswag else None
    optimizer = ZeroOptimizer(model, comm, args["z"], args["c"], master_weights=bool(args["w"]))
    run = dict(train_pattern=train_pattern, total_batch=total_batch, train_steps=train_steps, val_steps=val_steps,
               run_hellaswag=run_hellaswag, master_weights=optimizer.master is not None)
    log0(report.config_tables(args, run, model, backend, comm))
    if args["h"] and not run_hellaswag:
        log0(f"HellaSwag eval not found at {HELLASWAG_PATH}, skipping its evaluation")
        log0("You can run `python data/hellaswag.py` to export and use it with `-h 1`.")
    log0(report.allocation_lines(model, optimizer, B, T, total_batch, grad_accum, N))

    # ---- resuming ----
    scheduler = LRScheduler(args["k"], args["l"], args["u"], train_steps, args["q"])
    guard = UpdateGuard(args["sl"], args["sg"], args["max-nonfinite"])
    start_step = out.resume(model, optimizer, train_loader, guard) if args["y"] else 0
    if start_step > train_steps:
        raise UsageError(f"-o {args['o']}: its newest checkpoint is at step {start_step}, past this run's last step "
                         f"{train_steps}: raise -x to train on")
    if start_step:
        log0(f"resuming from checkpoint at step {start_step} in {args['o']}")
    throughput = report.Throughput(total_batch, config.flops_per_token(T) * B * T * grad_accum, backend.peak_flops())

    for step in range(start_step, train_steps + 1):
        last_step = step == train_steps
        if step % args["v"] == 0 or last_step:
            loss = val_loss(model, val_loader, val_steps, comm)
            log0(f"val loss {loss:f}")
            out.log(f"s:{step} tel:{loss:.4f}")
        if eval_loader is not None and (step > 0 and step % args["v"] == 0 or last_step):
            correct = hellaswag_correct(model, eval_loader, comm)
            accuracy = correct / eval_loader.num_examples
            log0(f"HellaSwag: {correct}/{eval_loader.num_examples} = {accuracy:f}")
            out.log(f"s:{step} eval:{accuracy:.4f}")
        if comm.rank == 0 and args["s"] > 0 and (step > 0 and step % args["s"] == 0 or last_step):
            tokens = generate(model, eot=eot, gen_tokens=args["g"], max_T=T)
            text = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
            print(f"generating:\n---\n{text}\n---")
        # a checkpoint, but never at the step a run starts or resumes from: that state is on disk or trivial
        if args["n"] > 0 and step > start_step and (step % args["n"] == 0 or last_step):
            log0(f"Writing checkpoint at step {step}")
            out.save(step, model, optimizer, train_loader, guard, comm, keep=args["nk"],
                     keep_every=args["nm"])
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
        out.log(f"s:{step} trl:{result.loss:.4f} lr:{lr:.6f} norm:{result.grad_norm:.2f}")

    if throughput.average_ms() is not None:
        log0(f"total average iteration time: {throughput.average_ms():f} ms")


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv in (["--help"], ["-help"]):
        print(usage())
        sys.exit(0)
    try:
        main(argv)
    except UsageError as e:
        launch.stop(f"error: {e} (--help lists the flags)")
    except (BackendError, CheckpointError, ConfigError, DataError, DivergedError, FormatError, TokenizerError,
            memory.NotEnoughMemory) as e:
        launch.stop(f"error: {e}")
    except MemoryError as e:   # the allocator's own (NumPy's, CuPy's): the count above missed something
        launch.stop(f"error: {memory.out_of_memory(e)}")
    except Exception:
        launch.stop(traceback.format_exc().rstrip())   # a bug: its traceback is the report; every rank stops
