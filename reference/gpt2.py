"""The reference GPT-2: llm.c's forward and backward composed from the layers, over a dict of arrays.

params maps llm.c's 16 names to arrays: wte (Vp, C), wpe (maxT, C), then per layer, stacked (L, ...) so that
layer l's ln1w is params["ln1w"][l]: ln1w, ln1b (L, C), qkvw (L, 3C, C), qkvb (L, 3C), attprojw (L, C, C),
attprojb (L, C), ln2w, ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C), fcprojw (L, C, 4C), fcprojb (L, C); and
lnfw, lnfb (C). Matrices are (out, in). config needs num_layers, num_heads and vocab_size. Everything runs
in the dtype of the arrays given (float64 for gradient checks, float32 to compare with the trainer).
"""
import numpy as np

from .adamw import BETA1, BETA2, EPS, adamw_update
from .attention import attention_backward, attention_forward
from .crossentropy import crossentropy_backward, crossentropy_forward
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .layernorm import layernorm_backward, layernorm_forward
from .matmul import matmul_backward, matmul_forward
from .residual import residual_backward, residual_forward

# AdamW's weight decay applies to the matrices only (the embeddings included), as in llm.c
WEIGHT_DECAY_NAMES = frozenset(("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"))


def gpt2_forward(params, config, inp, targets=None):
    """inp, targets (B, T) token ids -> logits (B, T, Vp), mean loss (a float, None without targets), cache.

    The cache holds every activation the backward needs."""
    p, NH = params, config.num_heads
    x = encoder_forward(inp, p["wte"], p["wpe"])                         # (B, T, C)
    layers = []
    for l in range(config.num_layers):
        ln1, ln1_mean, ln1_rstd = layernorm_forward(x, p["ln1w"][l], p["ln1b"][l])
        qkv = matmul_forward(ln1, p["qkvw"][l], p["qkvb"][l])          # (B, T, 3C)
        atty, att = attention_forward(qkv, NH)                          # (B, T, C), (B, NH, T, T)
        attproj = matmul_forward(atty, p["attprojw"][l], p["attprojb"][l])
        residual2 = residual_forward(x, attproj)
        ln2, ln2_mean, ln2_rstd = layernorm_forward(residual2, p["ln2w"][l], p["ln2b"][l])
        fch = matmul_forward(ln2, p["fcw"][l], p["fcb"][l])             # (B, T, 4C)
        fch_gelu = gelu_forward(fch)
        fcproj = matmul_forward(fch_gelu, p["fcprojw"][l], p["fcprojb"][l])
        residual3 = residual_forward(residual2, fcproj)
        layers.append(dict(residual=x, ln1=ln1, ln1_mean=ln1_mean, ln1_rstd=ln1_rstd, qkv=qkv, atty=atty,
                           att=att, residual2=residual2, ln2=ln2, ln2_mean=ln2_mean, ln2_rstd=ln2_rstd,
                           fch=fch, fch_gelu=fch_gelu))
        x = residual3
    lnf, lnf_mean, lnf_rstd = layernorm_forward(x, p["lnfw"], p["lnfb"])
    logits = matmul_forward(lnf, p["wte"])                              # (B, T, Vp): tied to wte, no bias
    cache = dict(inp=inp, targets=targets, layers=layers, residual=x, lnf=lnf, lnf_mean=lnf_mean,
                 lnf_rstd=lnf_rstd, probs=None)
    if targets is None:
        return logits, None, cache
    losses, cache["probs"] = crossentropy_forward(logits, targets, config.vocab_size)
    return logits, float(losses.mean()), cache


def gpt2_backward(params, config, cache):
    """The gradients of the mean loss over B*T positions: a dict with params' names and shapes."""
    if cache["probs"] is None:
        raise ValueError("gpt2_backward needs a forward with targets")
    p, NH = params, config.num_heads
    inp, targets, probs = cache["inp"], cache["targets"], cache["probs"]
    grads = {name: np.zeros_like(a) for name, a in p.items()}
    dlosses = np.full(targets.shape, 1 / targets.size, probs.dtype)     # d mean / d losses[b, t]
    dlogits = crossentropy_backward(probs, targets, dlosses)
    dlnf, dwte_head, _ = matmul_backward(dlogits, cache["lnf"], p["wte"], has_bias=False)
    dx, grads["lnfw"], grads["lnfb"] = layernorm_backward(dlnf, cache["residual"], p["lnfw"],
                                                          cache["lnf_mean"], cache["lnf_rstd"])
    for l in reversed(range(config.num_layers)):
        a = cache["layers"][l]
        # dx is d loss / d residual3 here
        dresidual2, dfcproj = residual_backward(dx)
        dfch_gelu, grads["fcprojw"][l], grads["fcprojb"][l] = matmul_backward(dfcproj, a["fch_gelu"],
                                                                              p["fcprojw"][l], has_bias=True)
        dfch = gelu_backward(dfch_gelu, a["fch"])
        dln2, grads["fcw"][l], grads["fcb"][l] = matmul_backward(dfch, a["ln2"], p["fcw"][l], has_bias=True)
        dresidual2_ln, grads["ln2w"][l], grads["ln2b"][l] = layernorm_backward(
            dln2, a["residual2"], p["ln2w"][l], a["ln2_mean"], a["ln2_rstd"])
        dresidual2 = dresidual2 + dresidual2_ln                         # both paths to residual2
        dresidual, dattproj = residual_backward(dresidual2)
        datty, grads["attprojw"][l], grads["attprojb"][l] = matmul_backward(dattproj, a["atty"],
                                                                            p["attprojw"][l], has_bias=True)
        dqkv = attention_backward(datty, a["qkv"], a["att"], NH)
        dln1, grads["qkvw"][l], grads["qkvb"][l] = matmul_backward(dqkv, a["ln1"], p["qkvw"][l],
                                                                   has_bias=True)
        dresidual_ln, grads["ln1w"][l], grads["ln1b"][l] = layernorm_backward(
            dln1, a["residual"], p["ln1w"][l], a["ln1_mean"], a["ln1_rstd"])
        dx = dresidual + dresidual_ln                                   # both paths to the layer's input
    dwte_embed, grads["wpe"] = encoder_backward(dx, inp, p["wte"].shape, p["wpe"].shape)
    # wte is used twice: lm_head and embedding
    grads["wte"] = dwte_head + dwte_embed
    return grads


def adamw_step(params, grads, m, v, t, lr, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0,
               grad_scale=1.0):
    """AdamW over every tensor -> new (params, m, v) dicts; the defaults are train_gpt2.cu's betas and eps.

    As llm.c, weight decay applies only to the matrices (WEIGHT_DECAY_NAMES)."""
    new_params, new_m, new_v = {}, {}, {}
    for name in params:
        decay = weight_decay if name in WEIGHT_DECAY_NAMES else 0.0
        new_params[name], new_m[name], new_v[name] = adamw_update(
            params[name], grads[name], m[name], v[name], t, lr, beta1, beta2, eps, decay, grad_scale)
    return new_params, new_m, new_v
