"""Token and position embeddings: out[b, t] = wte[inp[b, t]] + wpe[t]."""
import numpy as np


def encoder_forward(inp, wte, wpe):
    """inp (B, T) token ids, wte (Vp, C), wpe (maxT, C) -> out (B, T, C)."""
    T = inp.shape[1]
    return wte[inp] + wpe[:T]


def encoder_backward(dout, inp, wte_shape, wpe_shape):
    """dout (B, T, C) -> dwte (Vp, C), dwpe (maxT, C).

    d out[b, t] / d wte[inp[b, t]] = d out[b, t] / d wpe[t] = identity, so each position's gradient lands
    on its token's row of wte and on its position's row of wpe. A token that occurs twice gets both."""
    T = inp.shape[1]
    dwte = np.zeros(wte_shape, dout.dtype)
    np.add.at(dwte, inp, dout)           # scatter-add: repeated ids accumulate, unlike dwte[inp] += dout
    dwpe = np.zeros(wpe_shape, dout.dtype)
    dwpe[:T] = dout.sum(axis=0)          # positions are shared by the whole batch
    return dwte, dwpe
