"""The linear layer: out = x @ w^T + bias, with w stored (OC, C) as torch's nn.Linear.weight."""


def matmul_forward(x, w, bias=None):
    """x (..., C), w (OC, C), bias (OC) or None -> out (..., OC)."""
    OC, C = w.shape
    out = x.reshape(-1, C) @ w.T         # one 2-D product over all positions
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], OC)


def matmul_backward(dout, x, w, has_bias):
    """dout (..., OC) -> dx (..., C), dw (OC, C), dbias (OC) or None.

    out = x w^T + bias:  dx = dout w,  dw = dout^T x,  dbias = sum dout  (sums over every position)"""
    OC, C = w.shape
    dout2, x2 = dout.reshape(-1, OC), x.reshape(-1, C)
    dx = (dout2 @ w).reshape(x.shape)
    dw = dout2.T @ x2
    dbias = dout2.sum(axis=0) if has_bias else None
    return dx, dw, dbias
