"""The flat parameter layout: llm.c's 16 tensors, in llm.c's order, back to back in one buffer.

Parameters, gradients and AdamW's m and v all use this layout, so a checkpoint is one write of the
buffer and the optimizer is one pass over it. Per-layer tensors (ln1w .. fcprojb) store all L layers
contiguously, layer-major: layer l of tensor i starts at offset_i + l * size_i / L.
Matrices are (out_features, in_features), row-major, as torch's nn.Linear.weight.
"""
from math import prod

from reference.gpt2 import WEIGHT_DECAY_NAMES   # the matrices: AdamW's weight decay applies to them only

PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def param_shapes(config):
    """The 16 tensors' shapes, in llm.c's order."""
    Vp, maxT, L, C = config.padded_vocab_size, config.max_seq_len, config.num_layers, config.channels
    return {
        "wte": (Vp, C), "wpe": (maxT, C),
        "ln1w": (L, C), "ln1b": (L, C),
        "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C),
        "attprojw": (L, C, C), "attprojb": (L, C),
        "ln2w": (L, C), "ln2b": (L, C),
        "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
        "fcprojw": (L, C, 4 * C), "fcprojb": (L, C),
        "lnfw": (C,), "lnfb": (C,),
    }


def param_offsets(config):
    """name -> (offset, size) in elements within the flat buffer."""
    out, offset = {}, 0
    for name, shape in param_shapes(config).items():
        out[name] = (offset, prod(shape))
        offset += prod(shape)
    return out


def tensor_at(config, index):
    """The name of the tensor that holds flat element `index`, or None past num_parameters (the padding)."""
    offsets = param_offsets(config).items()
    return next((name for name, (offset, size) in offsets if index < offset + size), None)


class ParamViews:
    """Named views into one flat buffer: views.qkvw is the (L, 3C, C) slice of `flat`.

    Works for any array module (NumPy or CuPy): a reshape of a contiguous slice is a view."""

    def __init__(self, flat, config):
        self.flat = flat
        for name, shape in param_shapes(config).items():
            offset, size = param_offsets(config)[name]
            setattr(self, name, flat[offset:offset + size].reshape(shape))

    def __iter__(self):
        """(name, view) pairs in llm.c's order."""
        return ((name, getattr(self, name)) for name in PARAM_NAMES)

    def copies(self, dtype):
        """{name: a copy of the tensor in dtype}: the dict of named arrays reference/ computes with."""
        return {name: view.astype(dtype) for name, view in self}


def decay_segments(config, start, stop):
    """Split the flat range [start, stop) at the tensors' boundaries, each piece with its tensor's
    weight-decay flag.

    Returns [(lo, hi, decay)] in flat coordinates. A ZeRO shard cut from the flat buffer can straddle
    tensor boundaries; the optimizer runs once per segment so decay is exact element by element.
    Elements past num_parameters (the padding that makes the buffer divide by N) get decay False."""
    segments = []
    for name, (offset, size) in param_offsets(config).items():
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            segments.append((lo, hi, name in WEIGHT_DECAY_NAMES))
    total = config.num_parameters
    if stop > total and max(start, total) < stop:
        segments.append((max(start, total), stop, False))
    return segments
