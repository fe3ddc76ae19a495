"""The CPU backend: every layer op is reference/'s function, its result placed as the contract says.

The reference functions are pure (they return fresh arrays); this backend writes those results into the
model's buffers: forward outputs and activation gradients are assigned, parameter gradients are added.
Everything is float32, and the matmuls go to NumPy's BLAS.
"""
from concurrent.futures import ThreadPoolExecutor
import math
import os

import numpy as np

import reference as ref
from llm.launch import cores, local_ranks, threads_per_rank

CLASSIFIER_ROWS = 16    # positions per classifier slice: 16 x Vp floats of temporaries
ADAMW_CHUNK = 1 << 18   # elements per AdamW slice: its temporaries stay in cache, not 124M-element arrays
# the most arrays alive at once inside one op, measured: (B, NH, T, T) arrays in attention (3.3, 4 counted);
# chunk-sized ones in a thread's AdamW slice; (CLASSIFIER_ROWS, Vp) ones in a thread's classifier slice
ATTENTION_TEMPORARIES, ADAMW_TEMPORARIES, CLASSIFIER_TEMPORARIES = 4, 7, 2
CGROUP = "/sys/fs/cgroup"
# cgroup v2 and v1: (folder, limit file, usage file, the page cache the kernel reclaims before it kills)
CGROUP_FILES = {2: (CGROUP, "memory.max", "memory.current", "inactive_file"),
                1: (f"{CGROUP}/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                    "total_inactive_file")}


def _number(path, key=None):
    """The integer in a one-number file, or after `key` on a line of a "key value ..." file; None where
    there is no such file or line, or no number ("max": no limit)."""
    try:
        with open(path) as f:
            text = f.read()
        return int(text) if key is None else next(int(line.split()[1]) for line in text.splitlines()
                                                  if line.startswith(key + " "))
    except (OSError, ValueError, StopIteration):
        return None


def _cgroup_room():
    """What the memory cgroups around this process still allow (a Slurm job's --mem, a container's limit,
    which /proc/meminfo does not show): the least of limit - usage from its own cgroup up to the root;
    None where no cgroup sets a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    rooms = []
    for _, controllers, path in entries:
        if controllers and "memory" not in controllers.split(","):
            continue
        folder, limit, usage, cache = CGROUP_FILES[1 if controllers else 2]   # v2 names no controllers
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):   # a limit may be set on any cgroup above this one
            d = os.path.join(folder, *parts[:depth])
            lim, used = _number(os.path.join(d, limit)), _number(os.path.join(d, usage))
            if lim is not None and used is not None:
                rooms.append(lim - used + (_number(os.path.join(d, "memory.stat"), cache) or 0))
    return min(rooms, default=None)


def host_memory_available():
    """The bytes this process can still allocate on the host, None where unknown: /proc/meminfo's
    MemAvailable (os.sysconf's free pages where that file is missing), or less where a cgroup allows less."""
    available = _number("/proc/meminfo", "MemAvailable:")
    if available is not None:
        available *= 1024   # the file counts kB
    else:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):   # not a name this system knows
            return None
    room = _cgroup_room()
    return available if room is None else max(0, min(available, room))


def column_sums(x):
    """x (..., OC) summed over every position, as reference/matmul.py sums a bias gradient (the same bits)."""
    return x.reshape(-1, x.shape[-1]).sum(axis=0)


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

    def fetch(self, x):
        x = np.array(x)   # a copy now: later ops cannot change it
        return lambda: x

    cuda_graph = False   # no CUDA graphs on the CPU: run() just runs

    def run(self, key, work):
        work()

    def device_name(self):
        return f"CPU ({self.threads} threads of {cores()} cores, NumPy)"

    def synchronize(self):
        pass

    def peak_flops(self):
        return None   # no table of CPU peaks: MFU is not reported on the CPU

    def memory_available(self):
        """This rank's share of the host's available memory (host_memory_available), None where unknown."""
        available = host_memory_available()
        return None if available is None else available // local_ranks()

    def scratch_bytes(self, config, B, T):
        """The largest temporaries of one op (reference/'s functions return fresh arrays): attention's
        (B, NH, T, T) arrays, the lm_head's (B, T, Vp) output before it is copied into the logits, a (Vp, C)
        gradient of wte (the lm_head's and the encoder's) before it is added, or the slices that this
        rank's threads work on at once in AdamW and in the classifier."""
        NH, C, Vp, P = config.num_heads, config.channels, config.padded_vocab_size, config.num_parameters
        adamw = min(self.threads, -(-P // ADAMW_CHUNK)) * ADAMW_TEMPORARIES * min(ADAMW_CHUNK, P)
        classifier = CLASSIFIER_TEMPORARIES * min(self.threads * CLASSIFIER_ROWS, B * T) * Vp
        return np.dtype(self.dtype).itemsize * max(ATTENTION_TEMPORARIES * B * NH * T * T, B * T * Vp, Vp * C,
                                                   adamw, classifier)

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

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, dbias_below=None):
        dinp_, dw_, db_ = ref.layernorm_backward(dout, inp, w, mean, rstd)
        dinp += dinp_     # dinp is the residual stream's gradient: it already holds the skip path's share
        dw += dw_
        db += db_
        if dbias_below is not None:
            dbias_below += column_sums(dinp)

    def matmul_forward(self, out, inp, w, bias):
        out[...] = ref.matmul_forward(inp, w, bias)

    def wait(self, done):   # every op has finished when it returns
        pass

    def matmul_backward(self, dinp, dw, dbias, dout, inp, w):
        dinp[...], dw_, dbias_ = ref.matmul_backward(dout, inp, w, has_bias=dbias is not None)
        dw += dw_
        if dbias is not None:
            dbias += dbias_

    def matmul_gelu_forward(self, out, gelu_out, inp, w, bias):
        self.matmul_forward(out, inp, w, bias)
        self.gelu_forward(gelu_out, out)

    def matmul_gelu_backward(self, dinp, dw, dbias, dout, inp, w, pre_gelu, dbias_prev, recompute):
        if recompute:
            self.gelu_forward(inp, pre_gelu)
        done = self.matmul_backward(dinp, dw, dbias, dout, inp, w)
        dinp[...] = ref.gelu_backward(dinp, pre_gelu)
        if dbias_prev is not None:
            dbias_prev += column_sums(dinp)
        return done

    def attention_saved_shape(self, B, T, NH):
        return (B, NH, T, T), np.float32     # the softmax probabilities att

    def attention_forward(self, out, att, qkv, NH):
        out[...], att[...] = ref.attention_forward(qkv, NH)

    def attention_backward(self, dqkv, dbias, dout, qkv, out, att, NH):
        dqkv[...] = ref.attention_backward(dout, qkv, att, NH)   # the probabilities att make out unneeded
        if dbias is not None:
            dbias += column_sums(dqkv)

    def gelu_forward(self, out, inp):
        out[...] = ref.gelu_forward(inp)

    def fused_classifier(self, logits, losses, targets, V, dloss):
        """A few positions at a time, on this rank's threads: each slice's (rows, Vp) temporaries stay
        small."""
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
        scale = float(grad_scale)
        if math.isnan(scale):   # a non-finite loss or norm: nothing changes
            return

        def update(lo):
            s = slice(lo, lo + ADAMW_CHUNK)
            param[s], m[s], v[s] = ref.adamw_update(param[s], grad[s], m[s], v[s], t, lr, beta1, beta2, eps,
                                                    weight_decay, scale)
        list(self._pool.map(update, range(0, param.size, ADAMW_CHUNK)))

    def sumsq(self, x):
        return np.asarray(np.dot(x, x), dtype=np.float32)   # BLAS sdot: float32 accumulation
