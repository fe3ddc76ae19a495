"""The CPU backend: every layer op is reference/'s function, its result placed as the contract says.

The reference functions are pure (they return fresh arrays); this backend writes those results into the
model's buffers: forward outputs and activation gradients are assigned, parameter gradients are added.
Everything is float32, and the matmuls go to NumPy's BLAS.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import reference as ref
from llm.launch import cores, threads_per_rank

CLASSIFIER_ROWS = 16    # positions per classifier slice: 16 x Vp floats of temporaries
ADAMW_CHUNK = 1 << 18   # elements per AdamW slice: its temporaries stay in cache, not 124M-element arrays


class NumpyBackend:
    name = "numpy"
    xp = np
    dtype = np.float32
    precision = "fp32"

    def __init__(self):
        self.threads = threads_per_rank()   # this rank's share of the cores, as BLAS's own threads
        self._pool = ThreadPoolExecutor(max_workers=self.threads)

    def asarray(self, a, dtype=None):
        return np.array(a, dtype=dtype)        # a copy, as a host-to-device transfer would be

    def to_numpy(self, x):
        return np.array(x)

    def copy_in(self, dst, a):
        dst[...] = a

    cuda_graph = False   # no CUDA graphs on the CPU: run() just runs

    def run(self, key, work):
        work()

    def device_name(self):
        return f"CPU ({self.threads} threads of {cores()} cores, NumPy)"

    def synchronize(self):
        pass

    def peak_flops(self):
        return None   # no table of CPU peaks: MFU is not reported on the CPU

    def encoder_forward(self, out, inp, wte, wpe):
        out[...] = ref.encoder_forward(inp, wte, wpe)

    def encoder_backward(self, dwte, dwpe, dout, inp):
        dwte_, dwpe_ = ref.encoder_backward(dout, inp, dwte.shape, dwpe.shape)
        dwte += dwte_
        dwpe += dwpe_

    def layernorm_forward(self, out, mean, rstd, inp, w, b):
        out[...], mean[...], rstd[...] = ref.layernorm_forward(inp, w, b)

    def residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, w, b):
        residual[...] = ref.residual_forward(inp1, inp2)
        out[...], mean[...], rstd[...] = ref.layernorm_forward(residual, w, b)

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd):
        dinp_, dw_, db_ = ref.layernorm_backward(dout, inp, w, mean, rstd)
        dinp += dinp_     # dinp is the residual stream's gradient: it already holds the skip path's share
        dw += dw_
        db += db_

    def matmul_forward(self, out, inp, w, bias):
        out[...] = ref.matmul_forward(inp, w, bias)

    def matmul_backward(self, dinp, dw, dbias, dout, inp, w):
        dinp[...], dw_, dbias_ = ref.matmul_backward(dout, inp, w, has_bias=dbias is not None)
        dw += dw_
        if dbias is not None:
            dbias += dbias_

    def matmul_gelu_forward(self, out, gelu_out, inp, w, bias):
        self.matmul_forward(out, inp, w, bias)
        self.gelu_forward(gelu_out, out)

    def matmul_gelu_backward(self, dinp, dw, dbias, dout, inp, w, pre_gelu):
        self.matmul_backward(dinp, dw, dbias, dout, inp, w)
        self.gelu_backward(dinp, pre_gelu, dinp)

    def attention_saved_shape(self, B, T, NH):
        return (B, NH, T, T), np.float32     # the softmax probabilities att

    def attention_forward(self, out, att, qkv, NH):
        out[...], att[...] = ref.attention_forward(qkv, NH)

    def attention_backward(self, dqkv, dout, qkv, out, att, NH):
        dqkv[...] = ref.attention_backward(dout, qkv, att, NH)   # the probabilities att make out unneeded

    def gelu_forward(self, out, inp):
        out[...] = ref.gelu_forward(inp)

    def gelu_backward(self, dinp, inp, dout):
        dinp[...] = ref.gelu_backward(dout, inp)

    def residual_forward(self, out, inp1, inp2):
        out[...] = ref.residual_forward(inp1, inp2)

    def fused_classifier(self, logits, losses, targets, V, dloss):
        """A few positions at a time, on this rank's threads: each slice's (rows, Vp) temporaries stay small."""
        rows = logits.reshape(-1, logits.shape[-1])
        flat_losses, flat_targets = losses.reshape(-1), targets.reshape(-1)

        def classify(lo):
            s = slice(lo, lo + CLASSIFIER_ROWS)
            row_losses, probs = ref.crossentropy_forward(rows[None, s], flat_targets[None, s], V)
            flat_losses[s] = row_losses[0]
            if dloss is not None:
                dlosses = np.full(row_losses.shape, dloss, logits.dtype)
                rows[s] = ref.crossentropy_backward(probs, flat_targets[None, s], dlosses)[0]
        list(self._pool.map(classify, range(0, rows.shape[0], CLASSIFIER_ROWS)))

    def adamw(self, param, grad, m, v, master, lr, beta1, beta2, eps, weight_decay, t, grad_scale):
        """In place over one 1-D segment, a slice at a time; master is unused (the params are fp32).

        NumPy's element-wise ops use one core and release the GIL, so the slices go to this rank's threads."""
        def update(lo):
            s = slice(lo, lo + ADAMW_CHUNK)
            param[s], m[s], v[s] = ref.adamw_update(param[s], grad[s], m[s], v[s], t, lr, beta1, beta2, eps,
                                                    weight_decay, grad_scale)
        list(self._pool.map(update, range(0, param.size, ADAMW_CHUNK)))

    def sumsq(self, x):
        return np.asarray(np.dot(x, x), dtype=np.float32)   # BLAS sdot: float32 accumulation
