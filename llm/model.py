"""GPT-2: forward and backward over one flat parameter buffer, composed from a backend's layer ops.

The model never asks which backend it runs on: every op is `self.backend.<op>` on the backend's arrays
(see llm/backends/__init__.py for the contract). The three entry points are llm.c's:

  forward(inputs)            -> logits: the network up to the lm_head, and nothing else
  backward(targets, dloss)   -> losses: the fused classifier (losses and dlogits in one pass), then the
                                gradients of every layer, accumulated into grads
  validate(inputs, targets)  -> losses: forward and the classifier's losses alone (llm.c's gpt2_validate)

The device work of a forward or a backward (everything after the token ids are copied in) goes through
backend.run(key, work), which on the GPU may record it once as a CUDA graph and replay it: one launch instead
of some 150 from Python (llm/backends/graphs.py). That work reads and writes only buffers that stay put
(parameters, gradients, activations, scratch), so that a record of it stays valid.
"""
import numpy as np

from .layout import ParamViews


class Activations:
    """Every tensor the forward pass keeps for the backward pass, for one (B, T), allocated once.

    Per-layer tensors are stacked (L, ...) as in llm.c, so layer l's ln1 is acts.ln1[l]. With recompute
    (llm.c's -r) some are not kept: at 1 the GELU output, at 2 also the layernorm outputs; the backward
    recomputes each one from what is kept (fch, and the residual with its mean and rstd) just before use.

    One scratch buffer of B*T*max(Vp, 13C) holds the logits at the end of the forward and the start of the
    backward, and everything that lives only inside one layer before and after that, at fixed places:
      proj (C)      the attention and MLP projections' outputs, before the residual adds them (forward)
      datty (C)     the gradient at attention's output (backward; shares proj's place)
      dqkv (3C)     the gradient at qkv
      dfch (4C)     the gradient at fch
      gelu (4C)     fch_gelu of the current layer, when it is recomputed
      ln (C)        ln1 or ln2 of the current layer, when they are recomputed
    as in llm.c, whose "output" buffer serves the same turns."""

    @staticmethod
    def buffers(backend, config, B, T, recompute):
        """name -> (shape, dtype) of every buffer allocated, None for one that recompute drops. The memory
        estimate (llm/memory.py) sums these same shapes, so that it and the allocation cannot disagree."""
        dt, f32 = backend.dtype, np.float32
        L, C, Vp, NH = config.num_layers, config.channels, config.padded_vocab_size, config.num_heads
        att_shape, att_dtype = backend.attention_saved_shape(B, T, NH)
        return {
            "encoded": ((B, T, C), dt),
            "ln1": ((L, B, T, C), dt) if recompute < 2 else None,
            "ln1_mean": ((L, B, T), f32), "ln1_rstd": ((L, B, T), f32),
            "qkv": ((L, B, T, 3 * C), dt),
            "atty": ((L, B, T, C), dt),
            "att": ((L,) + tuple(att_shape), att_dtype),   # what attention keeps for its backward
            "residual2": ((L, B, T, C), dt),
            "ln2": ((L, B, T, C), dt) if recompute < 2 else None,
            "ln2_mean": ((L, B, T), f32), "ln2_rstd": ((L, B, T), f32),
            "fch": ((L, B, T, 4 * C), dt),
            "fch_gelu": ((L, B, T, 4 * C), dt) if recompute < 1 else None,
            "residual3": ((L, B, T, C), dt),
            "lnf": ((B, T, C), dt),
            "lnf_mean": ((B, T), f32), "lnf_rstd": ((B, T), f32),
            "inputs": ((B, T), np.int32), "targets": ((B, T), np.int32),   # token ids, copied in
            "losses": ((B, T), f32),
            "dresidual": ((B, T, C), dt),   # the residual stream's gradient, carried down the layers
            "dln": ((B, T, C), dt),         # the gradient at a layernorm's output
            "scratch": ((B * T * max(Vp, 13 * C),), dt),
        }

    def __init__(self, backend, config, B, T, recompute):
        C, Vp = config.channels, config.padded_vocab_size
        buffers = self.buffers(backend, config, B, T, recompute)
        for name, spec in buffers.items():
            setattr(self, name, None if spec is None else backend.xp.empty(*spec))
        self.nbytes = sum(getattr(self, name).nbytes for name, spec in buffers.items() if spec is not None)
        scratch = self.scratch
        self.logits = scratch[:B * T * Vp].reshape(B, T, Vp)   # after a training backward: dlogits

        def place(first, width):   # `width` channels per position, `first` B*T*C-sized units in
            return scratch[first * B * T * C:(first * C + width) * B * T].reshape(B, T, width)
        self.proj = self.datty = place(0, C)
        self.dqkv, self.dfch = place(1, 3 * C), place(4, 4 * C)
        self.gelu, self.ln = place(8, 4 * C), place(12, C)

    def ln1_of(self, l):
        return self.ln if self.ln1 is None else self.ln1[l]

    def ln2_of(self, l):
        return self.ln if self.ln2 is None else self.ln2[l]

    def fch_gelu_of(self, l):
        return self.gelu if self.fch_gelu is None else self.fch_gelu[l]


class GPT2:
    """GPT-2 with llm.c's flat buffers: params and grads are each one array; named views point into them."""

    def __init__(self, config, backend, recompute=1, flat_size=None):
        """flat_size: the length of params_flat and grads_flat, num_parameters or more. ZeRO-1 cuts the
        flat buffers into equal shards and asks for them padded (llm/zero.py: padded_size); the model
        never reads the padding."""
        if recompute not in (0, 1, 2):
            raise ValueError(f"recompute must be 0 (keep every activation), 1 (recompute GELU) or 2 "
                             f"(GELU and layernorms), not {recompute}")
        P = config.num_parameters
        flat_size = P if flat_size is None else flat_size
        if flat_size < P:
            raise ValueError(f"flat_size {flat_size} is less than the model's {P} parameters")
        self.config, self.backend, self.recompute = config, backend, recompute
        self.params_flat, self.grads_flat = (backend.xp.zeros(*s) for s in self.buffers(backend, flat_size))
        self.params = ParamViews(self.params_flat[:P], config)
        self.grads = ParamViews(self.grads_flat[:P], config)
        self._acts = {}        # (B, T) -> Activations
        self._pending = None   # the activations of the last forward, which backward starts from

    @staticmethod
    def buffers(backend, flat_size):
        """(shape, dtype) of params_flat and grads_flat, for __init__ and the estimate (as Activations')."""
        return [((flat_size,), backend.dtype)] * 2

    # ---- parameters in and out (host float32, the checkpoint's layout) ----
    def load_params(self, flat):
        """Set the parameters from a host float32 array of num_parameters elements (rounded to the
        parameters' type on the host, so the device never holds a float32 copy)."""
        self.params_flat[:self.config.num_parameters] = self.backend.asarray(flat, self.backend.dtype)

    def params_numpy(self):
        return self.backend.to_numpy(self.params_flat[:self.config.num_parameters]).astype(np.float32)

    def grads_numpy(self):
        return self.backend.to_numpy(self.grads_flat[:self.config.num_parameters]).astype(np.float32)

    def zero_grad(self):
        self.grads_flat.fill(0)

    def activations(self, B, T):
        if (B, T) not in self._acts:
            self._acts[(B, T)] = Activations(self.backend, self.config, B, T, self.recompute)
        return self._acts[(B, T)]

    # ---- forward ----
    def forward(self, inputs):
        """The logits (B, T, Vp) for token ids `inputs` (B, T); every activation is kept for backward()."""
        B, T = inputs.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length T={T} exceeds the model's max_seq_len "
                             f"{self.config.max_seq_len}")
        a = self.activations(B, T)
        self.backend.copy_in(a.inputs, np.ascontiguousarray(inputs, np.int32))
        self.backend.run(("forward", a), lambda: self._forward(a))
        self._pending = a
        return a.logits

    def _forward(self, a):
        cfg, be, p = self.config, self.backend, self.params
        L, NH = cfg.num_layers, cfg.num_heads
        be.encoder_forward(a.encoded, a.inputs, p.wte, p.wpe)
        out, mean, rstd, w, b = self._layernorm_before(a, 0)
        be.layernorm_forward(out, mean, rstd, a.encoded, w, b)
        for l in range(L):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            ln1, ln2, fch_gelu = a.ln1_of(l), a.ln2_of(l), a.fch_gelu_of(l)
            be.matmul_forward(a.qkv[l], ln1, p.qkvw[l], p.qkvb[l])
            be.attention_forward(a.atty[l], a.att[l], a.qkv[l], NH)
            be.matmul_forward(a.proj, a.atty[l], p.attprojw[l], p.attprojb[l])
            # residual2 = residual + proj, and ln2 of it, in one pass (as llm.c fuses them)
            be.residual_layernorm_forward(a.residual2[l], ln2, a.ln2_mean[l], a.ln2_rstd[l], residual, a.proj,
                                          p.ln2w[l], p.ln2b[l])
            be.matmul_gelu_forward(a.fch[l], fch_gelu, ln2, p.fcw[l], p.fcb[l])
            be.matmul_forward(a.proj, fch_gelu, p.fcprojw[l], p.fcprojb[l])
            # residual3 = residual2 + proj, and the next layer's ln1 of it (after the last layer: lnf)
            out, mean, rstd, w, b = self._layernorm_before(a, l + 1)
            be.residual_layernorm_forward(a.residual3[l], out, mean, rstd, a.residual2[l], a.proj, w, b)
        be.matmul_forward(a.logits, a.lnf, p.wte, None)   # the lm_head is tied to wte, no bias

    def _layernorm_before(self, a, l):
        """(out, mean, rstd, w, b) of the layernorm at the start of layer l: ln1, or lnf for l = L."""
        p = self.params
        if l == self.config.num_layers:
            return a.lnf, a.lnf_mean, a.lnf_rstd, p.lnfw, p.lnfb
        return a.ln1_of(l), a.ln1_mean[l], a.ln1_rstd[l], p.ln1w[l], p.ln1b[l]

    def validate(self, inputs, targets):
        """Per-position losses (B, T) float32 of a forward on `inputs`; no gradient is computed."""
        self.forward(inputs)
        a, self._pending = self._pending, None   # nothing to backpropagate: the logits stay logits
        self.backend.copy_in(a.targets, np.ascontiguousarray(targets, np.int32))
        self.backend.fused_classifier(a.logits, a.losses, a.targets, self.config.vocab_size, None)
        return a.losses

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
        a, self._pending = self._pending, None
        self.backend.copy_in(a.targets, np.ascontiguousarray(targets, np.int32))
        self.backend.run(("backward", a, dloss), lambda: self._backward(a, dloss))
        return a.losses

    def _backward(self, a, dloss):
        cfg, be, p, g = self.config, self.backend, self.params, self.grads
        L, NH = cfg.num_layers, cfg.num_heads
        # Each matmul_backward returns while its weight gradient may still run (on the GPU, beside the ops
        # after it): nothing else waits for a weight gradient, so the GPU can fill its idle units with one.
        # The weight gradients run in the order they were queued, and be.wait(done) makes the ops after it
        # wait for that one and those before it. Waits stand where an op overwrites what a queued one reads.
        be.fused_classifier(a.logits, a.losses, a.targets, cfg.vocab_size, dloss)
        lm_head = be.matmul_backward(a.dln, g.wte, None, a.logits, a.lnf, p.wte)   # logits holds dlogits now
        a.dresidual.fill(0)
        # Each layernorm backward also sums the residual stream's gradient it leaves, which is the gradient at
        # the output of the projection that added into the stream just below it: that projection's bias
        # gradient (lnf's and ln1's: the fcproj below; ln2's: attproj).
        be.layernorm_backward(a.dresidual, g.lnfw, g.lnfb, a.dln, a.residual3[L - 1], p.lnfw,
                              a.lnf_mean, a.lnf_rstd, g.fcprojb[L - 1])
        be.wait(lm_head)   # the layers' scratch (dfch, ...) lies where dlogits does
        qkv = None
        for l in reversed(range(L)):
            residual = a.encoded if l == 0 else a.residual3[l - 1]
            ln1, ln2, fch_gelu = a.ln1_of(l), a.ln2_of(l), a.fch_gelu_of(l)
            # dresidual = dloss/d residual3[l]: flows to fcproj's output and, unchanged, to residual2.
            # Back through fcproj and the GELU: dfch, and with it fc's bias gradient (dfch's column sums);
            # with recompute the GELU's output, which fcproj's weight gradient needs, is made again first
            fcproj = be.matmul_gelu_backward(a.dfch, g.fcprojw[l], None, a.dresidual, fch_gelu, p.fcprojw[l],
                                             a.fch[l], g.fcb[l], recompute=self.recompute >= 1)
            if self.recompute >= 2:
                be.wait(qkv)   # the layer above's qkv weight gradient reads ln, made again here
                be.layernorm_forward(ln2, a.ln2_mean[l], a.ln2_rstd[l], a.residual2[l], p.ln2w[l], p.ln2b[l])
            fc = be.matmul_backward(a.dln, g.fcw[l], None, a.dfch, ln2, p.fcw[l])   # fc's bias: done above
            be.wait(fcproj)   # it reads dresidual, which the layernorm backward adds into
            be.layernorm_backward(a.dresidual, g.ln2w[l], g.ln2b[l], a.dln, a.residual2[l], p.ln2w[l],
                                  a.ln2_mean[l], a.ln2_rstd[l], g.attprojb[l])
            # dresidual = dloss/d residual2[l]: flows to attproj's output and, unchanged, to residual
            attproj = be.matmul_backward(a.datty, g.attprojw[l], None, a.dresidual, a.atty[l], p.attprojw[l])
            # back through attention: dqkv, and with it qkv's bias gradient (dqkv's column sums); the layer
            # above's qkv weight gradient, which reads dqkv, was queued before fcproj's, waited for above
            be.attention_backward(a.dqkv, g.qkvb[l], a.datty, a.qkv[l], a.atty[l], a.att[l], NH)
            if self.recompute >= 2:
                be.wait(fc)   # it reads ln2 from ln, which ln1 takes now
                be.layernorm_forward(ln1, a.ln1_mean[l], a.ln1_rstd[l], residual, p.ln1w[l], p.ln1b[l])
            qkv = be.matmul_backward(a.dln, g.qkvw[l], None, a.dqkv, ln1, p.qkvw[l])   # qkv's bias: above
            be.wait(attproj)   # it reads dresidual (and fc's, queued before it, dfch: the next fcproj's)
            be.layernorm_backward(a.dresidual, g.ln1w[l], g.ln1b[l], a.dln, residual, p.ln1w[l],
                                  a.ln1_mean[l], a.ln1_rstd[l], g.fcprojb[l - 1] if l > 0 else None)
        be.wait(qkv)   # the last one queued: every weight gradient is done
        be.encoder_backward(g.wte, g.wpe, a.dresidual, a.inputs)
