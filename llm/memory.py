"""Memory: what a run needs, counted before anything large is allocated, against what there is.

A model or a batch too large for the machine would otherwise end in a MemoryError after minutes of set-up,
or, since Linux hands out memory it does not have until the pages are touched, in the OOM killer's kill -9,
which prints nothing. needed() counts the bytes from the (shape, dtype) lists that the allocating code itself
reads (GPT2.buffers, ZeroOptimizer.buffers, Activations.buffers), so that the count and the allocation
cannot disagree:

  parameters, gradients   the flat buffers at the padded size (llm/zero.py padded_size)
  AdamW m, v, master      this rank's shard at -z 1, else the whole buffer
  activations             at every (B, T) the run steps or samples at, with its recompute setting
  scratch                 the backend's largest temporaries (backend.scratch_bytes)
  host copies             where the backend's arrays are host arrays (NumPy): the float32 copies of the flat
                          buffer that loading the model (LOADING_COPIES) or a checkpoint (CHECKPOINT_COPIES)
                          holds beside them
and adds a margin for what is not counted (MARGIN_FRACTION, MARGIN_BYTES): the allocator's rounding and small
buffers; on the GPU, cuBLAS's and CUDA graphs' own memory, a few MiB of small scratch, and cuDNN's workspace
(--attention cudnn: about 1.5 GiB at d12, B=64). The host memory that a GPU run's copies take is not
checked. check() refuses, in one line, a run whose count exceeds what the backend says there is
(backend.memory_available()).
"""
import math

import numpy as np

from .launch import UserError
from .model import GPT2, Activations
from .zero import ZeroOptimizer, padded_size

# float32 copies of the flat buffer held at once on the host. Loading: the parameters read or drawn, and the
# copy the model takes of them (also more than a step's staging copy at -z 1 under MPI). A checkpoint: the
# parameters, m and v (on a resume master as well), the full buffer that a shard is gathered into or loaded
# from, and a copy of it (4 measured when one is written, 5 when one is read, at -z 0 and -z 1)
LOADING_COPIES, CHECKPOINT_COPIES = 2, 6
# what is not counted: nvidia-smi's peak exceeds the count by 0.8 GiB at d48, B=16 and by 2.4 GiB at B=60
# (the measured results), the CUDA context's 0.5 GiB included, which the free memory already leaves out
MARGIN_FRACTION, MARGIN_BYTES = 0.02, 256 << 20
TRAINING_ADVICE = "lower -b, use -r 2, a smaller -e, or -z 1 over more ranks on more GPUs or machines"


class NotEnoughMemory(UserError):
    """A run that needs more memory than there is: one line that says how much, how much there is, and
    what to lower."""


def nbytes(specs):
    """The bytes of a list of (shape, dtype), None for a buffer that is not allocated."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in filter(None, specs))


def needed(backend, config, shapes, recompute=1, train=True, zero_stage=0, world_size=1, master_weights=True,
           checkpoints=False):
    """-> {what: bytes} this rank allocates, from the same lists the allocation reads.

    shapes: every (B, T) the model runs a forward at (the batch, and each window a sample draws from);
    train: whether there is an optimizer (m, v, master); checkpoints: whether the run writes or reads them."""
    flat_size = padded_size(config.num_parameters, world_size, zero_stage)
    params, grads = GPT2.buffers(backend, flat_size)
    parts = {"parameters": nbytes([params]), "gradients": nbytes([grads])}
    if train:
        m, v, master = ZeroOptimizer.buffers(backend, flat_size, world_size, zero_stage, master_weights)
        parts.update({"AdamW m and v": nbytes([m, v]), "master weights": nbytes([master])})
    parts["activations"] = sum(nbytes(Activations.buffers(backend, config, B, T, recompute).values())
                               for B, T in set(shapes))
    parts["scratch"] = max(backend.scratch_bytes(config, B, T) for B, T in shapes)
    if backend.xp is np:
        copies = CHECKPOINT_COPIES if checkpoints else LOADING_COPIES
        parts["host copies"] = copies * flat_size * np.dtype(np.float32).itemsize
    return parts


def margin(parts):
    return int(MARGIN_FRACTION * sum(parts.values())) + MARGIN_BYTES


def size(n):
    """Bytes for people: GiB, or MiB below one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def check(parts, available, advice=TRAINING_ADVICE):
    """Raise NotEnoughMemory when parts (needed()'s) and the margin exceed `available` bytes (None: unknown,
    nothing to check)."""
    total = sum(parts.values()) + margin(parts)
    if available is not None and total > available:
        what = ", ".join(f"{name} {size(n)}" for name, n in parts.items() if n)
        raise NotEnoughMemory(f"not enough memory: this run needs {size(total)} ({what}, margin "
                              f"{size(margin(parts))}) and {size(available)} is available: {advice}")

