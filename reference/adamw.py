"""AdamW, element by element, as llm.c's adamw kernel (decoupled weight decay, scaled by lr)."""
import numpy as np

# llm.c's train_gpt2.cu hard-codes these at its AdamW call site; the trainer takes them from here too
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8


def adamw_update(param, grad, m, v, t, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0):
    """One step at 1-based step t -> new (param, m, v); grad_scale is the clipping factor.

      g = grad_scale * grad
      m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
      mhat = m / (1 - beta1^t),      vhat = v / (1 - beta2^t)     (bias corrections)
      param = param - lr (mhat / (sqrt(vhat) + eps) + weight_decay param)"""
    g = grad_scale * grad
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    mhat = m / (1 - beta1 ** t)
    vhat = v / (1 - beta2 ** t)
    param = param - lr * (mhat / (np.sqrt(vhat) + eps) + weight_decay * param)
    return param, m, v
