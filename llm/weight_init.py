"""llm.c's random init for models built from a descriptor (-e d12): torch.manual_seed(42), then normal_ on
each weight in PyTorch's module order, so the values agree with llm.c's (and PyTorch's) up to float32
rounding.

torch's CPU generator is a Mersenne Twister, the same one NumPy's legacy RandomState uses, so the raw 32-bit
draws match; what has to be reproduced here is how torch turns them into floats and normals.
"""
import math

import numpy as np

from .layout import ParamViews


def _mt19937_uniforms(rng, n):
    """n floats in [0, 1) as torch's uniform_real_distribution<float>: 24 random bits of one 32-bit draw."""
    return (rng.randint(0, 2**32, size=n, dtype=np.uint32) & 0xFFFFFF).astype(np.float32) / np.float32(2**24)


def _torch_normal(rng, n, std):
    """torch's CPU normal_ for n >= 16: Box-Muller on blocks of 16 uniforms (first 8 with the last 8),
    and when n % 16 != 0 the last 16 outputs are redrawn from 16 fresh uniforms."""
    def fill16(u):   # u: (blocks, 16)
        u1, u2 = 1 - u[:, :8], u[:, 8:]
        radius = np.sqrt(-2 * np.log(u1 + np.float32(1e-12)))
        theta = np.float32(2 * math.pi) * u2
        return np.concatenate([radius * np.cos(theta), radius * np.sin(theta)], axis=1) * np.float32(std)
    u = _mt19937_uniforms(rng, n)
    out = fill16(u[:n // 16 * 16].reshape(-1, 16)).reshape(-1)
    if n % 16:
        out = np.concatenate([out, np.zeros(n % 16, np.float32)])
        out[-16:] = fill16(_mt19937_uniforms(rng, 16).reshape(1, 16)).reshape(-1)
    return out


def init_params(config, seed=42):
    """llm.c's init for descriptor models, as a host float32 flat array.

    Weights ~ N(0, 0.02), the two residual projections (attprojw, fcprojw) ~ N(0, 0.02 / sqrt(2L)), layernorm
    weights 1, biases 0, padded wte rows 0. Draws follow llm.c's order from one Mersenne Twister seeded like
    torch.manual_seed(seed), so the values agree with llm.c's up to float32 rounding of log/cos/sin."""
    rng = np.random.RandomState(seed)   # legacy seeding = MT19937 init_genrand(seed), as torch and llm.c
    flat = np.zeros(config.num_parameters, np.float32)
    p = ParamViews(flat, config)
    L, V, C = config.num_layers, config.vocab_size, config.channels
    residual_std = 0.02 / math.sqrt(2 * L)
    for name in ("ln1w", "ln2w", "lnfw"):
        getattr(p, name)[...] = 1.0
    p.wte[:V] = _torch_normal(rng, V * C, 0.02).reshape(V, C)
    p.wpe[...] = _torch_normal(rng, p.wpe.size, 0.02).reshape(p.wpe.shape)
    for l in range(L):
        for name, std in (("qkvw", 0.02), ("attprojw", residual_std), ("fcw", 0.02),
                          ("fcprojw", residual_std)):
            w = getattr(p, name)[l]
            w[...] = _torch_normal(rng, w.size, std).reshape(w.shape)
    return flat
