"""What train_gpt2.py prints, in llm.c's words and layout: the configuration tables, the allocation lines,
the per-step line and its throughput figures (and, after llm.c's fields, the time left)."""
import math

import numpy as np

BORDER = "+" + "-" * 23 + "+" + "-" * 52 + "+"


def row(name, value):
    return f"| {name:<21} | {value:<50} |"


def table(rows):
    return "\n".join(row(name, value) for name, value in rows)


def config_tables(settings, model, optimizer, comm):
    """llm.c's tables: the flags, the device, the model, the batch counts and the ZeRO setup.

    settings: train_gpt2.py's Settings, the flags by llm.c's names and what main() derived from them."""
    s, config, backend = settings, model.config, model.backend
    peak = backend.peak_flops()
    init = s.load_filename if s.load_filename.endswith(".bin") else f"random ({s.load_filename})"
    return "\n".join([
        BORDER, row("Parameter", "Value"), BORDER,
        table([("train data pattern", s.train_pattern), ("val data pattern", s.val_data_pattern),
               ("output log dir", s.output_log_dir or "NULL"), ("checkpoint_every", s.checkpoint_every),
               ("resume", s.resume), ("micro batch size B", s.B), ("sequence length T", s.T),
               ("total batch size", s.total_batch_size), ("LR scheduler", s.lr_scheduler_type),
               ("learning rate (LR)", f"{s.learning_rate:e}"), ("warmup iterations", s.warmup_iterations),
               ("final LR fraction", f"{s.final_learning_rate_frac:e}"),
               ("weight decay", f"{s.weight_decay:e}"),
               ("skip update lossz", f"{s.skip_update_lossz:f}"),
               ("skip update gradz", f"{s.skip_update_gradz:f}"),
               ("max_steps", s.max_steps), ("val_loss_every", s.val_loss_every),
               ("val_max_steps", s.val_max_steps), ("sample_every", s.sample_every), ("genT", s.genT),
               ("overfit_single_batch", s.overfit_single_batch),
               ("use_master_weights", "enabled" if optimizer.master is not None else "disabled"),
               ("recompute", s.recompute)]),
        BORDER,
        table([("device", backend.device_name()), ("peak TFlops", f"{peak / 1e12 if peak else -1.0:.1f}"),
               ("precision", backend.precision.upper()),
               ("CUDA graphs", "enabled" if backend.cuda_graph else "disabled")]),
        BORDER,
        table([("weight init method", init), ("max_sequence_length T", config.max_seq_len),
               ("vocab_size V", config.vocab_size), ("padded_vocab_size Vp", config.padded_vocab_size),
               ("num_layers L", config.num_layers), ("num_heads NH", config.num_heads),
               ("channels C", config.channels), ("num_parameters", config.num_parameters)]),
        BORDER,
        table([("train_num_batches", s.train_num_batches), ("val_num_batches", s.val_num_batches)]),
        BORDER,
        row("run hellaswag", "yes" if s.run_hellaswag else "no"),
        BORDER,
        f"| {'Zero Stage1 is enabled' if s.zero_stage == 1 else 'Zero Optimization is disabled':<74} |",
        table([("num_processes", comm.world_size), ("zero_stage", s.zero_stage),
               ("communicator", comm.name)]),
        BORDER])


def allocation_lines(model, optimizer, settings):
    """llm.c's lines on the batch and the memory each buffer takes (MiB rounded down)."""
    config, B, T = model.config, settings.B, settings.T
    param_bytes = config.num_parameters * np.dtype(model.backend.dtype).itemsize
    lines = [f"num_parameters: {config.num_parameters} => bytes: {param_bytes}",
             f"allocated {param_bytes >> 20} MiB for model parameters",
             f"batch_size B={B} * seq_len T={T} * num_processes={settings.world_size} and "
             f"total_batch_size={settings.total_batch_size}",
             f"=> setting grad_accum_steps={settings.grad_accum_steps}",
             f"allocated {param_bytes >> 20} MiB for parameter gradients",
             f"allocated {model.activations(B, T).nbytes >> 20} MiB for activations",
             f"allocated {optimizer.m.nbytes >> 20} MiB for AdamW optimizer state m",
             f"allocated {optimizer.v.nbytes >> 20} MiB for AdamW optimizer state v"]
    if optimizer.master is not None:
        lines.append(f"allocated {optimizer.master.nbytes >> 20} MiB for master copy of params")
    return "\n".join(lines)


class Throughput:
    """llm.c's tok/s and MFU of each step, and our ETA. tok/s is the step's own rate at the first step, then
    an EMA (0.95) of the rates, bias-corrected; MFU is the step's FLOPs per second against the device's peak,
    None where the peak is not known (the CPU, a GPU missing from the table: llm.c prints -100% there). The
    ETA is an EMA of the step time, kept the same way, times the steps left."""

    def __init__(self, tokens_per_step, flops_per_step, peak_flops):
        self.tokens, self.flops, self.peak = tokens_per_step, flops_per_step, peak_flops
        self.ema, self.ema_ms, self.first_ms, self.steps, self.total_ms = 0.0, 0.0, 0.0, 0, 0.0

    def update(self, ms):
        """-> (tok/s, MFU or None) for a step that took ms milliseconds."""
        tok_s = self.tokens / ms * 1000
        if self.steps > 0:   # llm.c leaves the first step (compilation, allocation) out of the average
            self.ema = 0.95 * self.ema + 0.05 * tok_s
            self.ema_ms = 0.95 * self.ema_ms + 0.05 * ms
            tok_s = self.ema / (1 - 0.95 ** self.steps)
            self.total_ms += ms
        else:
            self.first_ms = ms
        self.steps += 1
        return tok_s, self.flops / (ms / 1000) / self.peak if self.peak else None

    def eta_s(self, steps_left):
        """Seconds that steps_left more steps take at the step time's EMA (after the first step: its time)."""
        ms = self.ema_ms / (1 - 0.95 ** (self.steps - 1)) if self.steps > 1 else self.first_ms
        return ms * steps_left / 1000

    def average_ms(self):
        """The mean step time after the first step, for llm.c's last line (None before two steps)."""
        return self.total_ms / (self.steps - 1) if self.steps > 1 else None


def duration(seconds):
    """A time as a person reads it: 42s, 3m07s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_line(step, train_steps, result, lr, ms, mfu, tok_s, precision, eta_s):
    """llm.c's per-step line, then ours: the ETA of the steps left (Throughput.eta_s); step is 0-based and
    printed 1-based.

    A value not known yet reads "n/a" where llm.c prints a number that looks like a bug: the z-scores
    over the first 128 steps, before their window fills (llm.c: "+nanz"), and the MFU where the device's
    peak is unknown (llm.c: "-100.0%")."""
    loss_z, norm_z = (f"{z:+.2f}z" if math.isfinite(z) else "z n/a" for z in (result.loss_z, result.norm_z))
    mfu = f"{100 * mfu:.1f}% {precision} MFU" if mfu is not None else f"{precision} MFU n/a"
    return (f"step {step + 1:4d}/{train_steps} | loss {result.loss:7.6f} ({loss_z})| "
            f"norm {result.grad_norm:6.4f} ({norm_z})| lr {lr:.2e} | {ms:.2f} ms | {mfu} | {tok_s:.0f} tok/s"
            f" | ETA {duration(eta_s)}")
