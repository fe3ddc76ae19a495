"""GPT-2: forward and backward over one flat parameter buffer, composed from a backend's layer ops.

The model never asks which backend it runs on: every op is `self.backend.<op>` on the backend's arrays
(see llm/backends/__init__.py for the contract). The three entry points are llm.c's:

  forward(inputs)            -> logits: the network up to the lm_head, and nothing else
  backward(targets, dloss)   -> losses: the fused classifier (losses and dlogits in one pass), then the
                                gradients of every layer, accumulated into grads
  validate(inputs, targets)  -> losses: forward and the classifier's losses alone (llm.c's gpt2_validate)
"""
import numpy as np

from .layout import ParamViews


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
    """GPT-2 with llm.c's flat buffers: params and grads are each one array; named views point into them."""

    def __init__(self, config, backend):
        self.config, self.backend = config, backend
        self.params_flat = backend.xp.zeros(config.num_parameters, backend.dtype)
        self.grads_flat = backend.xp.zeros(config.num_parameters, backend.dtype)
        self._views()
        self._acts = {}        # (B, T) -> Activations
        self._pending = None   # (acts, inputs) of the last forward, which backward starts from

    def _views(self):
        P = self.config.num_parameters
        self.params = ParamViews(self.params_flat[:P], self.config)
        self.grads = ParamViews(self.grads_flat[:P], self.config)

    def pad_flat(self, multiple):
        """Grow params_flat and grads_flat with zeros to a multiple of `multiple` elements.

        ZeRO-1 cuts the flat buffers into equal shards (llm/zero.py calls this); the model never reads
        the padding."""
        size = -(-self.config.num_parameters // multiple) * multiple
        if size != self.params_flat.size:
            for name in ("params_flat", "grads_flat"):
                padded = self.backend.xp.zeros(size, self.backend.dtype)
                padded[:self.config.num_parameters] = getattr(self, name)[:self.config.num_parameters]
                setattr(self, name, padded)
            self._views()

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
    def forward(self, inputs):
        """The logits (B, T, Vp) for token ids `inputs` (B, T); every activation is kept for backward()."""
        cfg, be, p = self.config, self.backend, self.params
        B, T = inputs.shape
        L, NH = cfg.num_layers, cfg.num_heads
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
        self._pending = (a, inp)
        return a.logits

    def validate(self, inputs, targets):
        """Per-position losses (B, T) float32 of a forward on `inputs`; no gradient is computed."""
        logits = self.forward(inputs)
        self._pending = None   # nothing to backpropagate: the logits stay logits
        losses = self.activations(*inputs.shape).losses
        self.backend.fused_classifier(logits, losses, self._targets(targets), self.config.vocab_size, None)
        return losses

    def _targets(self, targets):
        return self.backend.asarray(np.ascontiguousarray(targets, np.int32))

    # ---- backward ----
    def backward(self, targets, dloss):
        """Per-position losses (B, T) float32 of the last forward, and the gradients of sum(dloss * losses)
        accumulated (+=) into self.grads.

        dloss is each position's weight in the loss being minimised: 1 / (B * T * micro-steps) for the
        mean over a batch. It starts with the fused classifier, which writes the losses and, over the
        logits, dlogits = dloss * (probs - onehot) in one pass, as llm.c's. The residual adds need no op
        of their own: the gradient of x + f(x) passes unchanged to both branches, so one buffer, dresidual,
        carries the residual stream's gradient down the layers and each layernorm backward adds its
        branch's share into it."""
        if self._pending is None:
            raise RuntimeError("backward() needs a forward(inputs) first")
        cfg, be, p, g = self.config, self.backend, self.params, self.grads
        a, inp = self._pending
        self._pending = None
        L, NH = cfg.num_layers, cfg.num_heads
        be.fused_classifier(a.logits, a.losses, self._targets(targets), cfg.vocab_size, dloss)
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
        return a.losses
