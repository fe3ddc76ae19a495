"""LayerNorm over the channels: out = (x - mean) * rstd * w + b, biased variance, eps 1e-5 (as llm.c)."""
import numpy as np

EPS = 1e-5


def layernorm_forward(x, w, b):
    """x (..., C), w (C), b (C) -> out (..., C), mean (...), rstd (...)."""
    mean = x.mean(axis=-1)
    xc = x - mean[..., None]
    var = (xc * xc).mean(axis=-1)        # biased: divides by C, not C - 1
    rstd = 1 / np.sqrt(var + EPS)
    n = xc * rstd[..., None]             # normalized x
    return n * w + b, mean, rstd


def layernorm_backward(dout, x, w, mean, rstd):
    """dout (..., C) -> dx (..., C), dw (C), db (C).

    With n = (x - mean) * rstd and g = dout * w (the gradient at n):
      db = sum dout,  dw = sum dout * n  (both summed over every position)
      dx = rstd * (g - mean(g) - n * mean(g * n))   (means over C: the paths through mean and rstd)"""
    C = x.shape[-1]
    n = (x - mean[..., None]) * rstd[..., None]
    g = dout * w
    dx = rstd[..., None] * (g - g.mean(axis=-1, keepdims=True) - n * (g * n).mean(axis=-1, keepdims=True))
    dw = (dout * n).reshape(-1, C).sum(axis=0)
    db = dout.reshape(-1, C).sum(axis=0)
    return dx, dw, db
