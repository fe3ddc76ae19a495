"""Train GPT-2, as llm.c's train_gpt2.cu: same flags, same printed lines, same files.

  python train_gpt2.py -e d12 -b 4 -t 64                   one process (CPU, or GPU with --backend cupy)
  mpirun -np 2 python train_gpt2.py -e d12 -z 1            two ranks, ZeRO stage 1

main() reads top to bottom as llm.c's: build, print the configuration, then per step: validate, eval,
sample, checkpoint, and one training step (llm/step.py: forward, backward, reduce, norm, clip, update,
gather). The flags become one frozen Settings whose fields carry llm.c's variable names
(settings.learning_rate for -l).
"""
from dataclasses import make_dataclass, replace
import math
import os
import signal
import time

import llm   # noqa: F401   first: a missing package is one line naming the venv (llm/__init__.py)
import numpy as np

from llm import agreement, formats, launch, memory, report
from llm.backends import get_backend, resolve
from llm.checkpoint import OutputDir
from llm.comm import make_comm
from llm.config import GPT2_VOCAB, WEIGHTS_HINT, DescriptorError, GPT2Config
from llm.data import DataLoader, EvalLoader, score, shared_files_warning
from llm.formats import FormatError
from llm.launch import UsageError, install
from llm.model import GPT2
from llm.outliers import DivergedError, UpdateGuard
from llm.sample import generate, generate_shapes
from llm.schedulers import SCHEDULERS, LRScheduler
from llm.step import train_step
from llm.tokenizer import TokenizerFile
from llm.weight_init import init_params
from llm.zero import ZeroOptimizer, padded_size

HELLASWAG_PATH = "data/hellaswag/hellaswag_val.bin"
TOKENIZER_PATH = "gpt2_tokenizer.bin"
REPO = os.path.dirname(os.path.abspath(__file__))


def found(path):
    """A default path: in the current directory when it is there, else in the repository's root, where the
    data scripts write it (so a run started elsewhere finds `make data`'s files)."""
    in_repo = os.path.join(REPO, path)
    return in_repo if not os.path.exists(path) and os.path.exists(in_repo) else path


def one_of(*choices):
    return lambda v: v in choices, "one of " + ", ".join(map(str, choices))


# what a flag's value must be: (test, how to say it)
ANY = (lambda v: True, "")
POSITIVE = (lambda v: v > 0, "positive")
AT_LEAST_0 = (lambda v: v >= 0, "0 or more")
POSITIVE_OR_ALL = (lambda v: v > 0 or v == -1, "positive, or -1")
FRACTION = (lambda v: 0 <= v <= 1, "between 0 and 1")
ZERO_ONE = one_of(0, 1)

# flag -> (name, default, type, allowed values, meaning): llm.c's flags, variable names, defaults and
# meanings, then ours
FLAGS = {
    "-i": ("train_data_pattern", "data/tinyshakespeare/tiny_shakespeare_train.bin", str, ANY,
           "train data glob pattern"),
    "-j": ("val_data_pattern", "data/tinyshakespeare/tiny_shakespeare_val.bin", str, ANY,
           "val data glob pattern"),
    "-e": ("load_filename", "gpt2_124M_bf16.bin", str, ANY,
           "model .bin to load, or a descriptor: dL (d12) or dLcChNH (d2c64h4)"),
    "-o": ("output_log_dir", None, str, ANY, "output dir for main.log and checkpoints"),
    "-n": ("checkpoint_every", 0, int, AT_LEAST_0, "write a checkpoint every N steps (0: never)"),
    "-nk": ("checkpoints_keep", 0, int, AT_LEAST_0, "checkpoints to keep, older are deleted (0: keep all)"),
    "-nm": ("major_checkpoint_every", 0, int, AT_LEAST_0,
            "steps that are multiples of this are never deleted (0: off)"),
    "-y": ("resume", 0, int, ZERO_ONE, "resume from the newest complete checkpoint in -o (0/1)"),
    "-b": ("B", 4, int, POSITIVE, "micro batch size B per process"),
    "-t": ("T", 1024, int, POSITIVE, "sequence length T"),
    "-d": ("total_batch_size", -1, int, POSITIVE_OR_ALL,
           "total batch size in tokens (-1: B*T*N, no accumulation)"),
    "-x": ("max_steps", -1, int, POSITIVE_OR_ALL, "max steps (-1: one epoch of the train data)"),
    "-k": ("lr_scheduler_type", "cosine", str, one_of(*SCHEDULERS),
           "LR scheduler: cosine, linear, constant, wsd"),
    "-l": ("learning_rate", 3e-4, float, AT_LEAST_0, "learning rate"),
    "-u": ("warmup_iterations", 0, int, AT_LEAST_0, "warmup iterations"),
    "-q": ("final_learning_rate_frac", 1.0, float, FRACTION, "final LR fraction"),
    "-c": ("weight_decay", 0.0, float, AT_LEAST_0, "weight decay"),
    "-sl": ("skip_update_lossz", 0.0, float, AT_LEAST_0,
            "skip the update if the loss z-score exceeds this (0: off)"),
    "-sg": ("skip_update_gradz", 0.0, float, AT_LEAST_0,
            "skip the update if the grad-norm z-score exceeds this (0: off)"),
    "-v": ("val_loss_every", 20, int, POSITIVE, "val loss every N steps"),
    "-m": ("val_max_steps", 20, int, POSITIVE_OR_ALL, "val batches (-1: the whole val split)"),
    "-s": ("sample_every", 20, int, AT_LEAST_0, "sample every N steps (0: never)"),
    "-g": ("genT", 64, int, AT_LEAST_0, "tokens to generate"),
    "-h": ("hellaswag_eval", 0, int, ZERO_ONE, "HellaSwag eval (0/1), from " + HELLASWAG_PATH),
    "-a": ("overfit_single_batch", 0, int, ZERO_ONE,
           "overfit a single batch (0/1): train on the val data, no shuffle"),
    "-f": ("override_enable_tf32", 1, int, ZERO_ONE, "allow TF32 matmuls in fp32 on the GPU (0/1)"),
    "-w": ("use_master_weights", 1, int, ZERO_ONE,
           "keep fp32 master weights when the parameters are bf16 (0/1)"),
    "-z": ("zero_stage", 0, int, one_of(0, 1), "ZeRO stage: 0 (off) or 1 (shard the optimizer state)"),
    "-r": ("recompute", 1, int, one_of(0, 1, 2),
           "recompute in the backward to save memory: 0 none, 1 GELU, 2 GELU and layernorms"),
    "--backend": ("backend", "auto", str, one_of("auto", "numpy", "cupy"),
                  "numpy, cupy, or auto (cupy when a GPU is usable)"),
    "--precision": ("precision", "auto", str, one_of("auto", "fp32", "bf16"),
                    "fp32 or bf16 (auto: bf16 on the GPU, fp32 on the CPU)"),
    "--comm": ("communicator", "auto", str, one_of("auto", "nccl"),
               "auto, or nccl: NCCL between GPUs even for a single rank"),
    "--attention": ("attention", "auto", str, one_of("auto", "cudnn"),
                    f"auto (flash attention written here), or cudnn: cuDNN's ({install('cudnn')})"),
    "--cuda-graph": ("cuda_graph", 1, int, ZERO_ONE,
                     "replay each forward and backward as a recorded CUDA graph (0/1; the cupy backend "
                     "in bf16)"),
    "--max-nonfinite": ("max_nonfinite", 5, int, AT_LEAST_0,
                        "stop after this many steps in a row with a non-finite loss or grad norm "
                        "(0: never)"),
}
HELP = ("--help", "-help")   # and -h with no value after it: -h 1 is llm.c's HellaSwag flag
# llm.c's flags that have no use here, and what to do instead: a command copied from llm.c says so
LLMC_ONLY = {
    "-ge": "GELU fusion through cuBLASLt, which the bf16 path here always does: leave it out",
    "-lg": "NVML's GPU readings every N steps: leave it out, and watch nvidia-smi",
    **dict.fromkeys(("-pn", "-pr", "-pg", "-pi", "-ps", "-pf"),
                    "multi-node set-up without MPI: leave it out, and start the ranks with mpirun or srun, "
                    "which hand NCCL its id through MPI (docs/commands.md)"),
}

# What main() works out from the flags, set once. parse_args sets the first two; settle() the others, once
# the ranks, the model and the data are known, and it resolves -d's -1 in total_batch_size.
DERIVED = (("train_pattern", str),      # -a 1 trains on the val data: -j's pattern, else -i's
           ("warnings", tuple),         # lines for the user: a repeated flag, a warmup longer than the run
           ("world_size", int),         # the ranks that share each step's batch
           ("grad_accum_steps", int),   # micro-batches per step and rank
           ("train_num_batches", int),  # the steps of the run
           ("val_num_batches", int),    # the batches of each val loss
           ("run_hellaswag", bool))     # -h 1 and the file is there
# The parsed command line: one field per FLAGS row, under its name, then DERIVED. Frozen: nothing changes
# a setting half-way through a run.
Settings = make_dataclass("Settings", [(name, kind) for name, _, kind, _, _ in FLAGS.values()]
                          + [(name, kind, None) for name, kind in DERIVED], frozen=True)


def usage():
    lines = ["Usage: python train_gpt2.py [options]   (options come in pairs: -flag value)"]
    lines += [f"  {flag:<15} {meaning} (default {default})"
              for flag, (_, default, _, _, meaning) in FLAGS.items()]
    return "\n".join(lines)


def parse_args(argv):
    """-> Settings, with the flags' values and train_pattern; UsageError (one line) for an unknown flag or a
    value it cannot take. --help, -help, or -h with no value: the usage, and exit."""
    flags = argv[::2]
    if any(flag in HELP for flag in flags) or argv[-1:] == ["-h"] and len(argv) % 2:
        if launch.launched_rank() == 0:
            print(usage())
        raise SystemExit(0)
    for flag, value in zip(flags, argv[1::2] + [None]):   # a flag without its value shifts the pairs after it
        if value is None or value in FLAGS or value in LLMC_ONLY:
            followed = "" if value is None else f", it is followed by the flag {value}"
            raise UsageError(f"flag {flag} has no value{followed} (options come in pairs: -flag value)")
    values = {name: default for name, default, _, _, _ in FLAGS.values()}
    for flag, value in zip(flags, argv[1::2]):
        if flag in LLMC_ONLY:
            raise UsageError(f"{flag} is llm.c's {LLMC_ONLY[flag]}")
        if flag not in FLAGS:
            raise UsageError(f"unknown flag {flag}")
        name, _, kind, (allowed, what), meaning = FLAGS[flag]
        try:
            values[name] = kind(value)
        except ValueError:
            raise UsageError(f"flag {flag} needs {kind.__name__} value, got '{value}'") from None
        if kind is float and not math.isfinite(values[name]):
            raise UsageError(f"{flag} {value}: must be a finite number ({meaning})")
        if not allowed(values[name]):   # a list of choices says it all; a range says it with the meaning
            raise UsageError(f"{flag} {value}: must be {what}"
                             + ("" if what.startswith("one of") else f" ({meaning})"))
    for flag in ("-n", "-nk", "-nm", "-y"):   # the checkpoints: every, keep, keep multiples of, resume
        value = values[FLAGS[flag][0]]
        if value and not values["output_log_dir"]:
            raise UsageError(f"{flag} {value} needs -o, the directory that holds the checkpoints")
    warnings = tuple(f"{flag} is given {flags.count(flag)} times: the last, {flag} {values[FLAGS[flag][0]]}, "
                     f"counts" for flag in dict.fromkeys(flags) if flags.count(flag) > 1)
    for flag in ("-i", "-j", "-e"):
        if flag not in flags:
            values[FLAGS[flag][0]] = found(values[FLAGS[flag][0]])
    overfit = values["overfit_single_batch"]
    train_pattern = values["val_data_pattern"] if overfit else values["train_data_pattern"]
    return Settings(**values, train_pattern=train_pattern, warnings=warnings)


def settle(settings, world_size, train_loader, val_loader):
    """-> the final Settings: settings with the total batch, the accumulation, the steps of the run and of
    each val loss, and whether HellaSwag runs, worked out from the ranks and the data.
    UsageError (one line) where they do not fit together."""
    B, T = settings.B, settings.T
    tokens_per_fwdbwd = B * T * world_size
    total_batch = settings.total_batch_size if settings.total_batch_size > 0 else tokens_per_fwdbwd
    if total_batch % tokens_per_fwdbwd:
        raise UsageError(f"total batch size -d {total_batch} is not divisible by B*T*N = "
                         f"{B}*{T}*{world_size} = {tokens_per_fwdbwd}")
    epoch_tokens = train_loader.tokens_per_epoch
    train_steps = settings.max_steps if settings.max_steps > 0 else epoch_tokens // total_batch
    if train_steps == 0:
        raise UsageError(f"one epoch of '{settings.train_pattern}' ({epoch_tokens} tokens) is less than one "
                         f"step's total batch of {total_batch}: use a smaller -d, or -x")
    val_batches = val_loader.num_samples // (B * world_size)   # the whole split; -m never reads a batch twice
    val_steps = min(settings.val_max_steps, val_batches) if settings.val_max_steps > 0 else val_batches
    warnings = settings.warnings
    if settings.warmup_iterations > train_steps:
        warnings += (f"-u {settings.warmup_iterations}: the warmup is longer than the run's {train_steps} "
                     f"steps, so the learning rate never reaches -l {settings.learning_rate}",)
    return replace(settings, total_batch_size=total_batch, world_size=world_size, warnings=warnings,
                   grad_accum_steps=total_batch // tokens_per_fwdbwd, train_num_batches=train_steps,
                   val_num_batches=val_steps,
                   run_hellaswag=bool(settings.hellaswag_eval) and os.path.exists(found(HELLASWAG_PATH)))


def build_model(settings, backend, comm):
    """The model from a checkpoint file or a descriptor (llm.c's random init), its flat buffers sized for
    the ZeRO stage's shards; refused in one line, before its parameters are read or drawn, where the run
    would need more memory than there is."""
    source = settings.load_filename
    if source.endswith(".bin"):
        if not os.path.exists(source):
            raise FormatError(f"{source}: no such file: {WEIGHTS_HINT}; or train from scratch with -e d12")
        config, _ = formats.read_model_config(source)
    else:
        try:
            config = GPT2Config.from_descriptor(source)
        except DescriptorError as e:
            raise DescriptorError(f"{e}, or a model file (.bin)") from None
    B, T = settings.B, settings.T
    if T > config.max_seq_len:
        raise UsageError(f"-t {T} exceeds the model's max_seq_len {config.max_seq_len}")
    shapes = [(B, T)] + (generate_shapes(config, settings.genT, T) if settings.sample_every and comm.rank == 0
                         else [])
    memory.check(memory.needed(backend, config, shapes, settings.recompute, zero_stage=settings.zero_stage,
                               world_size=comm.world_size, master_weights=bool(settings.use_master_weights),
                               checkpoints=bool(settings.checkpoint_every or settings.resume)),
                 backend.memory_available())
    params = formats.read_model(source)[1] if source.endswith(".bin") else init_params(config)
    flat_size = padded_size(config.num_parameters, comm.world_size, settings.zero_stage)
    model = GPT2(config, backend, recompute=settings.recompute, flat_size=flat_size)
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


def sample_decoder(settings, config, log0):
    """The tokenizer file that decodes samples, checked against the model's vocab now rather than at the
    first sample; None when no samples are drawn or the file is missing (samples then print as ids)."""
    if settings.sample_every == 0:
        return None
    # the repository's (the data scripts') is GPT-2's: a model of another vocab brings its own, or prints ids
    path = found(TOKENIZER_PATH) if config.vocab_size == GPT2_VOCAB else TOKENIZER_PATH
    if not os.path.exists(path):
        log0(f"WARNING: {TOKENIZER_PATH} not found: samples print as token ids "
             "(python -m data.tinyshakespeare writes it)")
        return None
    return TokenizerFile(path, expected_vocab=config.vocab_size)


def preempted_line(step, start_step, out_dir):
    """What the run says when SIGUSR1 stops it at `step`, once the checkpoint of that step is written."""
    if step > start_step:
        return f"stopped by SIGUSR1 at step {step}: its checkpoint is in {out_dir}, -y 1 resumes it"
    if start_step:
        return f"stopped by SIGUSR1 at step {step}, the checkpoint it resumed from: -y 1 resumes it again"
    return "stopped by SIGUSR1 before the first step: nothing to save"


def main(argv):
    settings = parse_args(argv)
    name, precision = resolve(settings.backend, settings.precision)
    if settings.communicator == "nccl" and name != "cupy":
        raise UsageError("--comm nccl needs the cupy backend")
    comm = make_comm(gpu=name == "cupy", force_nccl=settings.communicator == "nccl")
    backend = get_backend(name, precision, allow_tf32=bool(settings.override_enable_tf32),
                          attention=settings.attention, cuda_graph=bool(settings.cuda_graph))
    log0 = print if comm.rank == 0 else (lambda *a, **k: None)
    if settings.override_enable_tf32 != 1 and not (backend.name == "cupy" and backend.precision == "fp32"):
        log0(f"note: -f {settings.override_enable_tf32} has no effect: TF32 applies to fp32 matmuls on the "
             f"GPU only")
    out = OutputDir(settings.output_log_dir, resume=settings.resume, comm=comm)   # locked for this run
    # SIGUSR1, Slurm's warning before it ends the job: with -o, a checkpoint after this step, then stop
    preemption = launch.Preemption(can_save=bool(settings.output_log_dir),
                                   why_not=": without -o there is nothing to save")
    np.seterr(all="ignore")   # a non-finite loss or norm is the guard's to report, in one line a step

    # ---- the model, the data and the optimizer ----
    model = build_model(settings, backend, comm)
    config = model.config
    B, T, world_size = settings.B, settings.T, comm.world_size
    train_loader = DataLoader(settings.train_pattern, B, T, comm.rank, world_size,
                              shuffle=not settings.overfit_single_batch, vocab_size=config.vocab_size)
    val_loader = DataLoader(settings.val_data_pattern, B, T, comm.rank, world_size, shuffle=False,
                            vocab_size=config.vocab_size)
    if not settings.overfit_single_batch and (warning := shared_files_warning(train_loader, val_loader)):
        log0(warning)   # (-a 1 trains on -j by design)
    settings = settle(settings, world_size, train_loader, val_loader)   # batch, steps: set once
    tokenizer = sample_decoder(settings, config, log0)
    eot = tokenizer.eot if tokenizer else config.eot
    eval_loader = EvalLoader(found(HELLASWAG_PATH), B, T, comm.rank, world_size, config.vocab_size, eot) \
        if settings.run_hellaswag else None
    agreement.check(comm, FLAGS, settings, model, [train_loader, val_loader, eval_loader])   # ranks alike
    optimizer = ZeroOptimizer(model, comm, settings.zero_stage, settings.weight_decay,
                              master_weights=bool(settings.use_master_weights))
    log0(report.config_tables(settings, model, optimizer, comm))
    if settings.hellaswag_eval and not settings.run_hellaswag:
        log0(f"HellaSwag eval not found at {HELLASWAG_PATH}, skipping its evaluation")
        log0("You can run `python -m data.hellaswag` to export and use it with `-h 1`.")
    for warning in settings.warnings:
        log0(f"warning: {warning}")
    log0(report.allocation_lines(model, optimizer, settings))

    # ---- resuming ----
    train_steps = settings.train_num_batches
    scheduler = LRScheduler(settings.lr_scheduler_type, settings.learning_rate, settings.warmup_iterations,
                            train_steps, settings.final_learning_rate_frac)
    guard = UpdateGuard(settings.skip_update_lossz, settings.skip_update_gradz, settings.max_nonfinite)
    start_step = out.resume(model, optimizer, train_loader, guard) if settings.resume else 0
    if start_step > train_steps:
        raise UsageError(f"-o {settings.output_log_dir}: its newest checkpoint is at step {start_step}, past "
                         f"this run's last step {train_steps}: raise -x to train on")
    if start_step:
        log0(f"resuming from checkpoint at step {start_step} in {settings.output_log_dir}")
    flops_per_step = config.flops_per_token(T) * B * T * settings.grad_accum_steps
    throughput = report.Throughput(settings.total_batch_size, flops_per_step, backend.peak_flops())
    result = None

    for step in range(start_step, train_steps + 1):
        last_step = step == train_steps
        if preemption.requested(comm):   # on any rank: every rank takes part in the checkpoint, and stops
            if step > start_step:
                log0(f"Writing checkpoint at step {step}")
                out.save(step, model, optimizer, train_loader, guard, comm)
            launch.stop(preempted_line(step, start_step, settings.output_log_dir), 128 + signal.SIGUSR1)
        if step % settings.val_loss_every == 0 or last_step:
            val = val_loss(model, val_loader, settings.val_num_batches, comm)
            log0(f"val loss {val:f}")
            out.log(f"s:{step} tel:{val:.4f}")
        if eval_loader is not None and (step > 0 and step % settings.val_loss_every == 0 or last_step):
            correct = hellaswag_correct(model, eval_loader, comm)
            accuracy = correct / eval_loader.num_examples
            log0(f"HellaSwag: {correct}/{eval_loader.num_examples} = {accuracy:f}")
            out.log(f"s:{step} eval:{accuracy:.4f}")
        if comm.rank == 0 and settings.sample_every > 0 and \
                (step > 0 and step % settings.sample_every == 0 or last_step):
            tokens = generate(model, eot=eot, gen_tokens=settings.genT, max_T=T)
            text = tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens))
            print(f"generating:\n---\n{text}\n---")
        # a checkpoint, but never at the step a run starts or resumes from: that state is on disk or trivial
        if settings.checkpoint_every > 0 and step > start_step and \
                (step % settings.checkpoint_every == 0 or last_step):
            log0(f"Writing checkpoint at step {step}")
            out.save(step, model, optimizer, train_loader, guard, comm, keep=settings.checkpoints_keep,
                     keep_every=settings.major_checkpoint_every)
        if last_step:
            break

        t0 = time.perf_counter()
        if settings.overfit_single_batch:
            train_loader.reset()   # overfit a single batch: the same batch every step
        batches = [train_loader.next_batch() for _ in range(settings.grad_accum_steps)]
        lr = scheduler(step)
        result = train_step(model, optimizer, batches, lr, step + 1, guard)
        if result.skipped:
            log0(result.skipped)
        # until the loss and norm are read: the update runs on into the next step's time, while the host
        # prints and queues that step, so a run of steps counts each update once
        ms = (time.perf_counter() - t0) * 1000
        tok_s, mfu = throughput.update(ms)
        log0(report.step_line(step, train_steps, result, lr, ms, mfu, tok_s, backend.precision,
                              throughput.eta_s(train_steps - step - 1)))
        out.log(f"s:{step} trl:{result.loss:.4f} lr:{lr:.6f} norm:{result.grad_norm:.2f}")

    if throughput.average_ms() is not None:
        log0(f"total average iteration time: {throughput.average_ms():f} ms")
    # a run that diverged in fewer steps than --max-nonfinite ends with a loss that says so
    if not math.isfinite(val) or result is not None and not math.isfinite(result.loss):
        losses = f"val {val}" + (f", train {result.loss}" if result is not None else "")
        raise DivergedError(f"the run ended with a non-finite loss ({losses}): it diverged; lower -l, or "
                            f"resume from an earlier checkpoint")


if __name__ == "__main__":
    launch.run(main, memory_advice=memory.TRAINING_ADVICE)
