"""GELU, tanh approximation (as GPT-2 and llm.c): y = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),
s = sqrt(2/pi)."""
import math

import numpy as np

GELU_SCALE = math.sqrt(2 / math.pi)
GELU_CUBIC = 0.044715


# x * x * x rather than x ** 3 (and t * t for t ** 2): NumPy's power is many times slower than a multiply
def gelu_forward(x):
    return 0.5 * x * (1 + np.tanh(GELU_SCALE * (x + GELU_CUBIC * x * x * x)))


def gelu_backward(dout, x):
    """With u = s (x + 0.044715 x^3):
    dy/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) s (1 + 3 * 0.044715 x^2)."""
    tanh_u = np.tanh(GELU_SCALE * (x + GELU_CUBIC * x * x * x))
    du_dx = GELU_SCALE * (1 + 3 * GELU_CUBIC * x * x)
    return dout * (0.5 * (1 + tanh_u) + 0.5 * x * (1 - tanh_u * tanh_u) * du_dx)
