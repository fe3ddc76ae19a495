"""Softmax and cross-entropy over the first V of Vp logits (as llm.c's classifier).

The padded columns V..Vp are not part of the vocabulary: they get probability 0 and gradient 0.
"""
import numpy as np


def crossentropy_forward(logits, targets, V):
    """logits (B, T, Vp), targets (B, T) in [0, V) -> losses (B, T), probs (B, T, Vp).

    losses = -log probs[target] = log(sum exp z) - z[target], with z the first V logits minus their max."""
    z = logits[..., :V] - logits[..., :V].max(axis=-1, keepdims=True)   # shifting by the max keeps exp finite
    probs = np.zeros_like(logits)
    np.exp(z, out=probs[..., :V])                                       # written in place: (B, T, V) is large
    total = probs.sum(axis=-1, keepdims=True)
    probs /= total
    z_target = np.take_along_axis(z, targets[..., None], axis=-1)
    losses = (np.log(total) - z_target)[..., 0]
    return losses, probs


def crossentropy_backward(probs, targets, dlosses):
    """probs (B, T, Vp), dlosses (B, T) -> dlogits (B, T, Vp).

    d losses[b, t] / d logits[b, t, i] = probs[i] - [i == target]. A padded column has probability 0
    and is never a target, so its gradient is 0."""
    dlogits = probs * dlosses[..., None]
    b, t = np.indices(targets.shape)
    dlogits[b, t, targets] -= dlosses                                   # the onehot term, at the targets only
    return dlogits
