"""GPT-2: forward and backward over one flat parameter buffer, composed from a backend's layer ops.

The model never asks which backend it runs on: every op is `self.backend.<op>` on the backend's arrays
(see llm/backends/__init__.py for the contract). The order of ops is llm.c's gpt2_forward/gpt2_backward.
"""
import math

import numpy as np

from .layout import ParamViews, param_offsets


class Activations:
    """Every tensor the forward pass keeps for the backward pass, for one (B, T), allocated once.

    Per-layer tensors are stacked (L, ...) as in llm.c, so layer l's ln1 is acts.ln1[l]."""

    def __init__(self, backend, config, B, T):
        xp, dt, f32 = backend.xp, backend.dtype, np.float32
        L, C, Vp, NH = config.num_layers, config.channels, config.padded_vocab_size, config.num_heads
        att_shape, att_dtype = backend.attention_saved_shape(B, T, NH)
        self.encoded = xp.empty((B, T, C), dt)
        self.ln1 = xp.empty((L, B, T, C), dt)
        self.ln1_mean, self.ln1_rstd = xp.empty((L, B, T), f32), xp.empty((L, B, T), f32)
        self.qkv = xp.empty((L, B, T, 3 * C), dt)
        self.atty = xp.empty((L, B, T, C), dt)
        self.att = xp.empty((L,) + tuple(att_shape), att_dtype)
        self.attproj = xp.empty((L, B, T, C), dt)
        self.residual2 = xp.empty((L, B, T, C), dt)
        self.ln2 = xp.empty((L, B, T, C), dt)
        self.ln2_mean, self.ln2_rstd = xp.empty((L, B, T), f32), xp.empty((L, B, T), f32)
        self.fch = xp.empty((L, B, T, 4 * C), dt)
        self.fch_gelu = xp.empty((L, B, T, 4 * C), dt)
        self.fcproj = xp.empty((L, B, T, C), dt)
        self.residual3 = xp.empty((L, B, T, C), dt)
        self.lnf = xp.empty((B, T, C), dt)
        self.lnf_mean, self.lnf_rstd = xp.empty((B, T), f32), xp.empty((B, T), f32)
        self.logits = xp.empty((B, T, Vp), dt)   # after a training forward: dlogits, in place
        self.losses = xp.empty((B, T), f32)
        # gradients of activations, reused across layers (the backward walks one layer at a time)
        self.dresidual = xp.empty((B, T, C), dt)  # the residual stream's gradient
        self.dln = xp.empty((B, T, C), dt)        # gradient at a layernorm's output
        self.datty = xp.empty((B, T, C), dt)
        self.dqkv = xp.empty((B, T, 3 * C), dt)
        self.dfch = xp.empty((B, T, 4 * C), dt)
        self.dfch_gelu = xp.empty((B, T, 4 * C), dt)
        self.nbytes = sum(a.nbytes for a in vars(self).values())


class GPT2:
    """GPT-2 with llm.c's flat buffers: params and grads are each one array; named views point into them.

    flat_size may exceed num_parameters: ZeRO pads the buffers so that they divide by the number of ranks.
    The padding is never read by the model."""

    def __init__(self, config, backend, flat_size=None):
        self.config, self.backend = config, backend
        P = config.num_parameters
        self.flat_size = flat_size or P
        self.params_flat = backend.xp.zeros(self.flat_size, backend.dtype)
        self.grads_flat = backend.xp.zeros(self.flat_size, backend.dtype)
        self.params = ParamViews(self.params_flat[:P], config)
        self.grads = ParamViews(self.grads_flat[:P], config)
        self._acts = {}        # (B, T) -> Activations
        self._last = None      # (acts, inputs) of the last forward, for backward

    # ---- parameters in and out (host float32, the checkpoint's layout) ----
    def load_params(self, flat):
        """Set the parameters from a host float32 array of num_parameters elements."""
        self.params_flat[:self.config.num_parameters] = self.backend.asarray(
            np.asarray(flat, np.float32)).astype(self.backend.dtype)

    def params_numpy(self):
        return self.backend.to_numpy(self.params_flat[:self.config.num_parameters]).astype(np.float32)

    def grads_numpy(self):
        return self.backend.to_numpy(self.grads_flat[:self.config.num_parameters]).astype(np.float32)

    def zero_grad(self):
        self.grads_flat.fill(0)

    def activations(self, B, T):
        if (B, T) not in self._acts:
            self._acts[(B, T)] = Activations(self.backend, self.config, B, T)
        return self._acts[(B, T)]

    # ---- forward ----
    def forward(self, inputs, targets=None, dloss=None):
        """Run the model on token ids `inputs` (B, T).

        Returns the logits (B, T, Vp) when there are no targets, else the per-position losses (B, T) float32.
        With dloss (training), the classifier also writes dlogits = dloss * (probs - onehot) over the
        logits buffer in the same pass, as llm.c's fused classifier does; backward() starts from there."""
        cfg, be, p = self.config, self.backend, self.params
        B, T = inputs.shape
        L, NH, V = cfg.num_layers, cfg.num_heads, cfg.vocab_size
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length T={T} exceeds the model's max_seq_len {cfg.max_seq_len}")
        a = self.activations(B, T)
        inp = be.asarray(np.ascontiguousarray(inputs, np.int32))
        be.encoder_forward(a.encoded, inp, p.wte, p.wpe)
        for l in range(L):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            be.layernorm_forward(a.ln1[l], a.ln1_mean[l], a.ln1_rstd[l], residual, p.ln1w[l], p.ln1b[l])
            be.matmul_forward(a.qkv[l], a.ln1[l], p.qkvw[l], p.qkvb[l])
            be.attention_forward(a.atty[l], a.att[l], a.qkv[l], NH)
            be.matmul_forward(a.attproj[l], a.atty[l], p.attprojw[l], p.attprojb[l])
            be.residual_forward(a.residual2[l], residual, a.attproj[l])
            be.layernorm_forward(a.ln2[l], a.ln2_mean[l], a.ln2_rstd[l], a.residual2[l], p.ln2w[l], p.ln2b[l])
            be.matmul_forward(a.fch[l], a.ln2[l], p.fcw[l], p.fcb[l])
            be.gelu_forward(a.fch_gelu[l], a.fch[l])
            be.matmul_forward(a.fcproj[l], a.fch_gelu[l], p.fcprojw[l], p.fcprojb[l])
            be.residual_forward(a.residual3[l], a.residual2[l], a.fcproj[l])
        be.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, a.residual3[L - 1], p.lnfw, p.lnfb)
        be.matmul_forward(a.logits, a.lnf, p.wte, None)   # the lm_head is tied to wte, no bias
        self._last = None
        if targets is None:
            return a.logits
        tgt = be.asarray(np.ascontiguousarray(targets, np.int32))
        be.fused_classifier(a.logits, a.losses, tgt, V, dloss)
        if dloss is not None:
            self._last = (a, inp)
        return a.losses

    # ---- backward ----
    def backward(self):
        """Accumulate (+=) the gradients of the last training forward into self.grads.

        The residual adds need no op of their own: the gradient of x + f(x) passes unchanged to both
        branches, so one buffer, dresidual, carries the residual stream's gradient down the layers and
        each layernorm backward adds its branch's share into it."""
        if self._last is None:
            raise RuntimeError("backward() needs a forward(inputs, targets, dloss) first")
        cfg, be, p, g = self.config, self.backend, self.params, self.grads
        a, inp = self._last
        L, NH = cfg.num_layers, cfg.num_heads
        be.matmul_backward(a.dln, g.wte, None, a.logits, a.lnf, p.wte)   # logits holds dlogits now
        a.dresidual.fill(0)
        be.layernorm_backward(a.dresidual, g.lnfw, g.lnfb, a.dln, a.residual3[L - 1], p.lnfw,
                              a.lnf_mean, a.lnf_rstd)
        for l in reversed(range(L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            # dresidual = dloss/d residual3[l]: flows to fcproj's output and, unchanged, to residual2
            be.matmul_backward(a.dfch_gelu, g.fcprojw[l], g.fcprojb[l], a.dresidual, a.fch_gelu[l], p.fcprojw[l])
            be.gelu_backward(a.dfch, a.fch[l], a.dfch_gelu)
            be.matmul_backward(a.dln, g.fcw[l], g.fcb[l], a.dfch, a.ln2[l], p.fcw[l])
            be.layernorm_backward(a.dresidual, g.ln2w[l], g.ln2b[l], a.dln, a.residual2[l], p.ln2w[l],
                                  a.ln2_mean[l], a.ln2_rstd[l])
            # dresidual = dloss/d residual2[l]: flows to attproj's output and, unchanged, to residual
            be.matmul_backward(a.datty, g.attprojw[l], g.attprojb[l], a.dresidual, a.atty[l], p.attprojw[l])
            be.attention_backward(a.dqkv, a.datty, a.qkv[l], a.att[l], NH)
            be.matmul_backward(a.dln, g.qkvw[l], g.qkvb[l], a.dqkv, a.ln1[l], p.qkvw[l])
            be.layernorm_backward(a.dresidual, g.ln1w[l], g.ln1b[l], a.dln, residual, p.ln1w[l],
                                  a.ln1_mean[l], a.ln1_rstd[l])
        be.encoder_backward(g.wte, g.wpe, a.dresidual, inp)
        self._last = None


# ---- llm.c's random init: torch.manual_seed(42) and normal_ in PyTorch's module order ----
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
        for name, std in (("qkvw", 0.02), ("attprojw", residual_std), ("fcw", 0.02), ("fcprojw", residual_std)):
            w = getattr(p, name)[l]
            w[...] = _torch_normal(rng, w.size, std).reshape(w.shape)
    return flat
