"""Data parallelism and ZeRO stage 1: who owns which slice of the optimizer, and the step's collectives.

-z 0  every rank keeps full m, v (and master weights); gradients are all-reduced (averaged) and every
      rank applies the same update to the whole buffer.
-z 1  the flat buffers are padded to a multiple of the number of ranks N (padded_size: the model is
      allocated at that size from the start) and rank r owns the contiguous shard
      [r*S, (r+1)*S), S = ceil(P / N). It keeps m, v and the fp32 master weights for its shard only.
      Gradients are reduce-scattered (averaged) into the shard, the global norm is the square root of
      the all-reduced sum of the shards' squared norms, AdamW updates the shard (weight decay applied
      element by element where the shard straddles tensor boundaries), and an all-gather brings every
      rank the full updated parameters.

The shard is cut from the flat buffer, as the original ZeRO-1 proposal for llm.c did (PR #309), not per
tensor and per layer as llm.c does today. One contiguous range means one reduce-scatter, one AdamW pass
and one all-gather per step, and any N works: padding replaces llm.c's demand that N divide every
tensor's per-layer size.

The step's order, as llm.c's main loop: reduce_gradients, the loss and the norm (loss_and_norm), clip
(clip_scale), update, gather_params. llm/step.py runs them. The loss and the norm stay on the device, and so
does the clipping factor computed from them, so that the update can be queued before the host has read
either (read).
"""
from dataclasses import dataclass
import math

import numpy as np

from reference.adamw import BETA1, BETA2, EPS

from .layout import decay_segments

GRAD_CLIP = 1.0   # the global gradient norm is clipped to this


@dataclass
class StepStats:
    """The step's loss sum and squared gradient norm (ZeroOptimizer.loss_and_norm): on the device for the
    update, and on their way to the host for read()."""
    device: object   # float32 (2,) backend array
    host: object     # backend.fetch's waiter: () -> the same two values as a host array


def padded_size(num_parameters, world_size, zero_stage):
    """The length of the flat buffers (params, grads, m, v): at -z 1 num_parameters rounded up to a
    multiple of world_size, so that every rank's shard has the same length; else num_parameters.
    The model is allocated at this size (GPT2(..., flat_size=...)); it never reads the padding."""
    multiple = world_size if zero_stage == 1 else 1
    return -(-num_parameters // multiple) * multiple


def clip_scale(xp, stats, clip=GRAD_CLIP):
    """The factor AdamW multiplies each gradient by so that the global norm is at most `clip`, from
    loss_and_norm's stats, as a 0-d float32 array computed where they are (xp: numpy or cupy) without the
    host: clip / norm above clip, else 1 (clip / max(norm, clip) is both), in float64 as the host would.
    NaN when the loss or the norm is not finite: AdamW then leaves everything as it is, since one NaN
    would otherwise turn every parameter into NaN."""
    norm = xp.sqrt(stats[1].astype(xp.float64))
    finite = xp.isfinite(stats[0]) & xp.isfinite(norm)
    return xp.where(finite, clip / xp.maximum(norm, clip), xp.nan).astype(xp.float32)


class ZeroOptimizer:
    """AdamW over this rank's shard of the model's flat buffers, and the collectives around it.

    master_weights: keep an fp32 copy of this shard's parameters to update (llm.c's -w), when the
    parameters themselves are stored in a narrower type (bf16); with fp32 parameters there is nothing to
    keep."""

    def __init__(self, model, comm, zero_stage, weight_decay, master_weights=True):
        if zero_stage not in (0, 1):
            raise ValueError(f"ZeRO stage {zero_stage} is not supported: use -z 0 or -z 1")
        be, world_size = model.backend, comm.world_size
        self.model, self.comm, self.stage, self.weight_decay = model, comm, zero_stage, weight_decay
        size = padded_size(model.config.num_parameters, world_size, zero_stage)
        if model.params_flat.size != size:
            raise ValueError(f"ZeRO stage {zero_stage} over {world_size} ranks needs flat buffers of {size} "
                             f"elements, the model has {model.params_flat.size}: build it with "
                             f"GPT2(..., flat_size=padded_size(P, world_size, zero_stage))")
        buffers = self.buffers(be, size, world_size, zero_stage, master_weights)
        self.m, self.v, self.master = (None if spec is None else be.xp.zeros(*spec) for spec in buffers)
        self.shard_size = self.m.size
        self.lo = comm.rank * self.shard_size if zero_stage == 1 else 0
        self.hi = self.lo + self.shard_size
        self.master_ready = False
        self.segments = [(lo - self.lo, hi - self.lo, decay)
                         for lo, hi, decay in decay_segments(model.config, self.lo, self.hi)]

    @staticmethod
    def buffers(backend, flat_size, world_size, zero_stage, master_weights=True):
        """(shape, dtype) of this rank's m, v and master (None where none is kept), for __init__ and the
        memory estimate (llm/memory.py) alike: a shard of flat_size / world_size at -z 1, else all of it."""
        shard = ((flat_size // world_size if zero_stage == 1 else flat_size,), np.float32)
        narrow = np.dtype(backend.dtype).itemsize < 4
        return [shard, shard, shard if master_weights and narrow else None]

    @property
    def grad_shard(self):
        return self.model.grads_flat[self.lo:self.hi]

    @property
    def param_shard(self):
        return self.model.params_flat[self.lo:self.hi]

    def reduce_gradients(self):
        """Average the gradients across ranks: the whole buffer (-z 0) or just this rank's shard (-z 1)."""
        if self.stage == 1:
            self.comm.reduce_scatter_avg(self.model.grads_flat, self.grad_shard)
        else:
            self.comm.all_reduce_avg(self.model.grads_flat)

    def loss_and_norm(self, loss_sum):
        """StepStats: [the sum of every rank's loss_sum, the squared global norm of the averaged gradients],
        a float32 (2,) array on the device, with no wait for it, and its copy to the host under way. The
        squared norm is the sum of the ranks' parts: at -z 1 each shard's; at -z 0 every rank holds all the
        gradients, so rank 0's sum is the norm and the others add zero."""
        be = self.model.backend
        if self.stage == 0 and self.comm.rank > 0:
            sumsq = be.xp.zeros((), np.float32)   # rank 0's sum is the norm: no need to take it again
        else:
            sumsq = be.sumsq(self.grad_shard)
        stats = be.xp.stack([be.xp.asarray(loss_sum, dtype=np.float32), sumsq])
        self.comm.all_reduce_sum(stats)
        return StepStats(stats, be.fetch(stats))

    def read(self, stats, positions):
        """(mean loss over the step's positions on every rank, global gradient norm) from loss_and_norm's
        stats, as host floats: the step's wait for the device, which waits for them alone, not for the
        update queued after them."""
        loss_sum, sumsq = (float(x) for x in stats.host())
        return loss_sum / (positions * self.comm.world_size), math.sqrt(sumsq)

    def update(self, lr, t, stats):
        """AdamW on this rank's shard, t the 1-based step, each gradient times clip_scale(stats), the
        clipping; nothing changes when the loss or the norm is not finite. Queued without a wait."""
        be = self.model.backend
        params, grads = self.param_shard, self.grad_shard
        grad_scale = clip_scale(be.xp, stats.device)
        if self.master is not None and not self.master_ready:
            self.master[...] = params   # widened element by element, with no float32 temporary
            self.master_ready = True
        for lo, hi, decay in self.segments:
            be.adamw(params[lo:hi], grads[lo:hi], self.m[lo:hi], self.v[lo:hi],
                     None if self.master is None else self.master[lo:hi],
                     lr, BETA1, BETA2, EPS, self.weight_decay if decay else 0.0, t, grad_scale)

    def gather_params(self):
        """Bring every rank the parameters the others updated (-z 1; with -z 0 every rank has them all)."""
        if self.stage == 1:
            self.comm.all_gather(self.param_shard, self.model.params_flat)

    # ---- checkpoints hold the full buffers, so a run can resume with any number of ranks ----
    def full_state(self):
        """(m, v, master or None) as host float32 arrays of num_parameters, gathered from every rank."""
        P = self.model.config.num_parameters
        out = []
        for buf in (self.m, self.v, self.master):
            if buf is None:
                out.append(None)
                continue
            if self.stage == 1:
                full = self.model.backend.xp.zeros(self.model.params_flat.size, np.float32)
                self.comm.all_gather(buf, full)
                buf = full
            out.append(self.model.backend.to_numpy(buf[:P]).astype(np.float32))
        return tuple(out)

    def load_full_state(self, m, v, master):
        """Take this rank's shard of full host m, v (and master) arrays."""
        be, P = self.model.backend, self.model.config.num_parameters
        for dst, src in ((self.m, m), (self.v, v), (self.master, master)):
            if dst is None:
                continue
            full = np.zeros(self.model.params_flat.size, np.float32)
            full[:P] = src if src is not None else self.model.params_numpy()
            dst[...] = be.asarray(full[self.lo:self.hi])
        if self.master is not None:
            self.master_ready = True
