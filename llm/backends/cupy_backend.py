"""The GPU backend: cuBLAS for the matmuls, raw CUDA kernels (kernels/*.cu) for everything else.

Storage is bf16 by default (parameters, gradients, activations), with fp32 arithmetic inside every
kernel and fp32 accumulation in cuBLAS; AdamW's m, v and master weights, LayerNorm's mean and rstd and
the losses are fp32. precision="fp32" stores everything in fp32 (matmuls in TF32 when allow_tf32).
No op synchronizes with the host (the token ids, too, are copied in without a wait), and the scratch
buffers are allocated once per shape and reused.
Each launcher sits here beside the math it computes; the compiling, the scratch buffers and the
cuBLAS calls are in cuda.py, attention in attention.py (one class per algorithm, picked here once),
CUDA graphs in graphs.py.
"""
import math

import numpy as np
import cupy
import cupyx

from llm.launch import local_ranks
from . import BackendError
from .attention import FlashAttention, HopperFlashAttention, NaiveAttention
from .cuda import BF16, BLOCK, FP32, Blas, BlasLt, Kernels, Scratch, blocks, check_int32, check_packs
from .graphs import Graph, GraphCache

# dense bf16 tensor-core peaks with fp32 accumulation, by device name; fp32 runs on TF32 units at half
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


class CupyBackend:
    name = "cupy"
    xp = cupy

    def __init__(self, precision="bf16", allow_tf32=True, attention="flash", cuda_graph=False):
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"unknown precision '{precision}': choose bf16 or fp32")
        self.precision = precision
        self.dtype = BF16 if precision == "bf16" else FP32
        device = cupy.cuda.Device()
        self.num_sms = device.attributes["MultiProcessorCount"]
        self.shared_per_block = device.attributes["MaxSharedMemoryPerBlockOptin"]
        self.kernels, self.scratch = Kernels(), Scratch()
        self.blas, self.lt = Blas(allow_tf32), BlasLt(allow_tf32)
        # The weight gradients' stream, and its own cuBLASLt workspace (matmul_backward). A blocking stream:
        # outside a CUDA graph, the default stream and it wait for each other, so the ops run one after
        # another; a graph records the model's waits alone, and the GPU runs the rest side by side.
        self.beside, self.beside_workspace = cupy.cuda.Stream(), cupy.empty(BlasLt.WORKSPACE, cupy.uint8)
        if precision == "fp32":   # the checking precision: exact attention
            self.attention = NaiveAttention(self.kernels, self.scratch, self.blas, self.dtype)
        elif attention == "cudnn":
            from .cudnn_attention import CudnnAttention
            self.attention = CudnnAttention()
        elif device.compute_capability == "90":   # Hopper: wgmma and the copy engine
            self.attention = HopperFlashAttention(self.kernels, self.scratch, self.num_sms)
        else:
            self.attention = FlashAttention(self.kernels, self.scratch)
        # fp32's attention calls cuBLAS through CuPy, which refuses to be recorded: graphs in bf16 only
        self.cuda_graph = cuda_graph and precision == "bf16"
        self.graphs = GraphCache(self._record)
        self.pinned = {}   # copy_in's host buffer and its last copy's event, per destination

    # ---------------------------------------------------------------- arrays

    def asarray(self, a, dtype=None):
        """Host array -> device array; a float32 -> bf16 cast rounds to nearest even (ml_dtypes)."""
        a = np.asarray(a, dtype=dtype, order="C")   # a 0-d array stays 0-d
        if a.dtype == BF16:  # bf16 crosses as its raw 16-bit pattern
            return cupy.asarray(a.view(np.uint16)).view(BF16)
        return cupy.asarray(a)

    def to_numpy(self, x):
        """Device array -> host array; bf16 comes back as float32."""
        if x.dtype == BF16:
            return x.view(cupy.uint16).get().view(BF16).astype(np.float32)
        return x.get()

    def copy_in(self, dst, a):
        # Through a page-locked (pinned) host buffer kept for dst: a copy from pinned memory is queued like
        # a kernel, so the host goes on queueing the step while the GPU still runs the last one. From
        # pageable memory the copy would first wait for the GPU to finish everything before it. The buffer
        # is refilled only once its last copy has run (its event).
        key = (dst.data.ptr, dst.shape, dst.dtype)
        if key not in self.pinned:
            self.pinned[key] = (cupyx.empty_pinned(dst.shape, dst.dtype),
                                cupy.cuda.Event(disable_timing=True))
        host, copied = self.pinned[key]
        copied.synchronize()
        host[...] = a
        dst.set(host, stream=cupy.cuda.get_current_stream())
        copied.record()

    def fetch(self, x):
        # into pinned memory, then an event: waiting on the event waits for this copy, where x.get() would
        # wait for everything queued on the stream, the update after it included
        x = cupy.ascontiguousarray(x)
        host, done = cupyx.empty_pinned(x.shape, x.dtype), cupy.cuda.Event(disable_timing=True)
        runtime = cupy.cuda.runtime
        runtime.memcpyAsync(host.ctypes.data, x.data.ptr, x.nbytes, runtime.memcpyDeviceToHost,
                            cupy.cuda.get_current_stream().ptr)
        done.record()

        def result():
            done.synchronize()
            return host
        return result

    def run(self, key, work):
        if self.cuda_graph:
            self.graphs.run(key, work)
        else:
            work()

    def _record(self, work):
        # what a replay reads and writes must outlive the graph: the scratch buffers of this moment (and
        # cuDNN's workspace) are kept with it, in case a later shape replaces them
        return Graph(work, keep=(self.scratch.buffers(), getattr(self.attention, "workspace", None)))

    def synchronize(self):
        cupy.cuda.get_current_stream().synchronize()

    def device_name(self):
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        return name.decode() if isinstance(name, bytes) else name

    def peak_flops(self):
        for key, bf16 in PEAK_BF16_FLOPS.items():
            if key in self.device_name():
                return bf16 if self.precision == "bf16" else bf16 / 2
        return None

    def memory_available(self):
        """Free device memory, plus what CuPy's pool holds unused, shared among the ranks that share this GPU
        (more ranks than GPUs: host-staged MPI)."""
        free, _ = cupy.cuda.runtime.memGetInfo()
        sharing = -(-local_ranks() // cupy.cuda.runtime.getDeviceCount())
        return (free + cupy.get_default_memory_pool().free_bytes()) // sharing

    def scratch_bytes(self, config, B, T):
        """The attention's scratch at (B, T). Not counted: cuDNN's workspace (unknown until it plans a shape),
        and the few MiB of the layernorm and bias backward's partial sums."""
        NH = config.num_heads
        shapes = self.attention.scratch_shapes(B, T, NH, config.channels // NH).values()
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in shapes)

    def _kernel(self, family, name, dtype=None, **defines):
        return self.kernels.get(family, name, self.dtype if dtype is None else dtype, **defines)

    def _buffer(self, name, shape, dtype=None):
        return self.scratch.get(name, shape, self.dtype if dtype is None else np.dtype(dtype))

    def _elementwise(self, family, name, out, *inputs):
        """Launch a one-thread-per-pack kernel(out, *inputs, n) over n = out.size elements."""
        check_packs((out, *inputs), n=out.size)
        pack = 16 // out.dtype.itemsize
        self._kernel(family, name)((blocks(out.size // pack),), (BLOCK,), (out, *inputs, out.size))

    ADD_PHASES = 32   # add_partial_sums's threads a column, each on every 32nd row

    def _add_partial_sums(self, outs, partial):
        """outs[i][j] += sum over the rows k of partial[k, i * n + j] (reduce.cu), in a fixed order: the
        second stage of up to three column sums of width n, in one launch."""
        n, (rows, width) = outs[0].size, partial.shape
        self._kernel("reduce", "add_partial_sums", ADD_PHASES=self.ADD_PHASES)(
            (blocks(width, 32),), (32, self.ADD_PHASES),
            (*outs, *[None] * (3 - len(outs)), partial, np.int32(rows), np.int32(n), np.int32(len(outs))))

    # ---------------------------------------------------------------- encoder

    def encoder_forward(self, out, inp, wte, wpe):
        B, T, C = out.shape
        check_packs((out, wte, wpe), C=C)
        check_int32("inp", inp)
        pack = 16 // out.dtype.itemsize
        self._kernel("encoder", "encoder_forward")(
            (blocks(B * T * C // pack),), (BLOCK,),
            (out, inp, wte, wpe, np.int32(B * T), np.int32(T), np.int32(C)))

    def encoder_backward(self, dwte, dwpe, dout, inp):
        # dwte[inp[b,t]] += dout[b,t] and dwpe[t] += sum_b dout[b,t]: the embedding lookup's adjoint.
        B, T, C = dout.shape
        check_packs((dwte, dwpe, dout), C=C)
        check_int32("inp", inp)
        pack = 16 // dout.dtype.itemsize
        self._kernel("encoder", "encoder_backward_wpe")((blocks(T * C // pack),), (BLOCK,),
                                                        (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))
        # a stable device sort (thrust, no host sync) groups equal tokens for the atomic-free dwte sum
        order = cupy.argsort(inp.reshape(-1))
        threads = min(C // pack, 1024)
        self._kernel("encoder", "encoder_backward_wte")(
            (B * T,), (threads,), (dwte, dout, inp, order, np.int32(B * T), np.int32(C)))

    # ---------------------------------------------------------------- layernorm

    # layernorm_backward's warps per block, one block an SM: as many as this and the shared memory that holds
    # each warp's sums allow (16 at C = 768, 10 at 1600 on a Hopper). Alone on an H100, d12 B=64: 16 and 12
    # warps 0.164 ms, 8 0.169, 6 0.185; d48 B=16: 10 and 8 0.110 ms, 6 0.114.
    LN_WARPS = 16

    def layernorm_forward(self, out, mean, rstd, inp, w, b):
        self._layernorm_forward(None, out, mean, rstd, inp, None, w, b)

    def residual_layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, w, b):
        # residual = inp1 + inp2, out = layernorm(residual): one pass (layernorm.cu)
        check_packs((residual, inp2), C=inp1.shape[-1])
        self._layernorm_forward(residual, out, mean, rstd, inp1, inp2, w, b)

    def _layernorm_forward(self, residual, out, mean, rstd, inp1, inp2, w, b):
        C = inp1.shape[-1]
        N = inp1.size // C
        check_packs((out, inp1, w, b), C=C)
        self._kernel("layernorm", "layernorm_forward", CHANNELS=C)(
            (blocks(N, BLOCK // 32),), (BLOCK,), (residual, out, mean, rstd, inp1, inp2, w, b, np.int32(N)))

    def layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, dbias_below=None):
        # dinp += rstd (g - mean(g) - n mean(g n)), n = (x - mean) rstd, g = w dout;
        # dw += sum dout n; db += sum dout; dbias_below += sum dinp (as updated)
        C = inp.shape[-1]
        N = inp.size // C
        check_packs((dinp, dout, inp, w), C=C)
        sums = 2 if dbias_below is None else 3
        # a warp's sums take the shared memory the kernel's layout says (read from the module with the most
        # warps, which is the one launched when they fit)
        slice_bytes = self.kernels.value("layernorm", "layernorm_backward_slice_bytes", self.dtype,
                                         CHANNELS=C, WARPS=self.LN_WARPS, SUMS=sums)
        warps = min(self.LN_WARPS, self.shared_per_block // slice_bytes)
        if warps == 0:
            raise BackendError(f"the cupy backend's layernorm backward needs {slice_bytes:,} bytes of shared "
                               f"memory a warp at C = {C}, more than this GPU gives a block "
                               f"({self.shared_per_block:,}): use a narrower model or --backend numpy")
        grid = min(blocks(N, warps), self.num_sms)
        partial = self._buffer(f"ln_partial{sums}", (grid, sums * C), FP32)
        kernel = self._kernel("layernorm", "layernorm_backward", CHANNELS=C, WARPS=warps, SUMS=sums)
        if kernel.max_dynamic_shared_size_bytes < warps * slice_bytes:
            kernel.max_dynamic_shared_size_bytes = warps * slice_bytes
        kernel((grid,), (32 * warps,), (dinp, partial, dout, inp, w, mean, rstd, np.int32(N)),
               shared_mem=warps * slice_bytes)
        self._add_partial_sums((dw, db, dbias_below)[:sums], partial)

    # ---------------------------------------------------------------- matmul
    # Through cuBLASLt (cuda.py), whose epilogues add the bias, and in bf16 apply GELU, inside the GEMM. In
    # fp32, the checking precision, GELU stays our own kernel, exactly the reference's.

    def matmul_forward(self, out, inp, w, bias):
        # out (N, OC) = inp (N, C) @ w^T + bias, w (OC, C); column-major: out^T = op_T(w) inp^T
        OC, C = w.shape
        N = inp.size // C
        self.lt.matmul("T", "N", OC, N, C, w, C, inp, C, out, OC, epilogue="none" if bias is None else "bias",
                       bias=bias)

    def matmul_gelu_forward(self, out, gelu_out, inp, w, bias):
        # out = inp @ w^T + bias, gelu_out = gelu(out): one GEMM whose epilogue keeps its input (aux)
        if self.dtype != BF16:
            self.matmul_forward(out, inp, w, bias)
            self.gelu_forward(gelu_out, out)
            return
        OC, C = w.shape
        N = inp.size // C
        self.lt.matmul("T", "N", OC, N, C, w, C, inp, C, gelu_out, OC, epilogue="gelu_aux_bias", bias=bias,
                       aux=out, aux_ld=OC)

    def matmul_backward(self, dinp, dw, dbias, dout, inp, w):
        # dinp = dout @ w (overwritten), dw += dout^T @ inp, dbias += column sums of dout; returns the
        # weight gradient's event (_weight_gradient), for wait()
        OC, C = w.shape
        N = inp.size // C
        self.lt.matmul("N", "N", C, N, OC, w, C, dout, OC, dinp, C)       # dinp^T = w^T dout^T
        self._bias_gradient(dbias, dout)
        return self._weight_gradient(dw, dout, inp)

    def matmul_gelu_backward(self, dinp, dw, dbias, dout, inp, w, pre_gelu, dbias_prev, recompute):
        # the layer after a GELU (fcproj): dinp = gelu'(pre_gelu) * (dout @ w). One pass of
        # bias_backward_partial (matmul.cu) applies GELU's derivative, sums dinp's columns (dbias_prev, the
        # bias gradient of the layer that made pre_gelu: fc) and, on recompute, writes inp = gelu(pre_gelu)
        # for the weight gradient. cuBLASLt's DGELU epilogue made the GEMM slower by more than that pass
        # takes (0.551 against 0.399 ms at d12, B=64), and its DGELU_BGRAD three times slower.
        OC, C = w.shape
        N = inp.size // C
        self.lt.matmul("N", "N", C, N, OC, w, C, dout, OC, dinp, C)
        self._bias_gradient(dbias_prev, dinp, pre_gelu, inp if recompute else None)
        self._bias_gradient(dbias, dout)
        return self._weight_gradient(dw, dout, inp)

    def _weight_gradient(self, dw, dout, inp):
        # dw^T += inp^T dout. One with fewer 128 x 256 output tiles than the GPU has SMs leaves SMs idle: it
        # runs on the weight gradients' stream, beside the ops queued after it, once the work queued so far
        # is done. A larger one fills the GPU alone, and beside the next ops it would only contend with them
        # (docs/results.md): it runs in place. Either way the returned event, recorded on that stream, marks
        # the end of this one and of every one queued before it, for wait().
        OC, C = dw.shape
        N = inp.size // C
        beside = dw.size < self.num_sms * 128 * 256
        if not beside:
            self.lt.matmul("N", "T", C, OC, N, inp, C, dout, OC, dw, C, beta=1.0)
        queued, done = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
        queued.record()
        self.beside.wait_event(queued)
        with self.beside:
            if beside:
                self.lt.matmul("N", "T", C, OC, N, inp, C, dout, OC, dw, C, beta=1.0,
                               workspace=self.beside_workspace)
            done.record()
        return done

    def wait(self, done):
        """The work queued after this waits for the weight gradient whose event matmul_backward returned."""
        if done is not None:
            cupy.cuda.get_current_stream().wait_event(done)

    BIAS_BLOCKS_PER_SM = 4   # bias_backward_partial's blocks an SM, all in one wave

    def _bias_gradient(self, dbias, dout, pre_gelu=None, gelu_out=None):
        # dbias += dout's column sums (dout a gradient, or fp32 partial sums), by our own kernel (matmul.cu),
        # through a GELU when pre_gelu is given: cuBLASLt's epilogue for it (BGRADB) made each
        # weight-gradient GEMM slower by more than the kernel takes
        if dbias is None and pre_gelu is None:
            return
        OC = dout.shape[-1]
        N = dout.size // OC
        check_packs((dout, *(x for x in (pre_gelu, gelu_out) if x is not None)), OC=OC)
        pack = 16 // dout.dtype.itemsize
        col_blocks = blocks(OC // pack, 32)
        # rounded down to what one wave holds: at d48 (OC = 6400) rounding up made 550 blocks for 528 places,
        # and the pass took 346 us instead of 303 (H100)
        row_blocks = max(1, min(blocks(N, 8), self.BIAS_BLOCKS_PER_SM * self.num_sms // col_blocks))
        # one buffer per width: the MLP's pass and the qkv sums take turns, and one shared buffer would be
        # reallocated at each turn when the step runs op by op
        partial = self._buffer(f"bias_partial{OC}", (row_blocks, OC), FP32)
        self._kernel("matmul", "bias_backward_partial", dout.dtype, BLOCKS_PER_SM=self.BIAS_BLOCKS_PER_SM)(
            (col_blocks, row_blocks), (32, 8), (partial, dout, np.int32(N), np.int32(OC), pre_gelu, gelu_out))
        if dbias is not None:
            self._add_partial_sums((dbias,), partial)

    # ---------------------------------------------------------------- attention
    # self.attention, picked once above (attention.py, cudnn_attention.py), does the work

    def attention_saved_shape(self, B, T, NH):
        return self.attention.saved_shape(B, T, NH)

    def attention_forward(self, out, saved, qkv, NH):
        self.attention.forward(out, saved, qkv, NH)

    def attention_backward(self, dqkv, dbias, dout, qkv, out, saved, NH):
        # dbias += dqkv's column sums. The flash kernels add them up from the registers that write dqkv, 16
        # rows at a time (bias_sums: one fp32 row per 16 of dqkv's, an eighth of its bytes), which spares a
        # pass that reads dqkv back; the other algorithms return None, and dqkv itself is summed
        bias_sums = self.attention.backward(dqkv, dout, qkv, out, saved, NH)
        self._bias_gradient(dbias, dqkv if bias_sums is None else bias_sums)

    # ---------------------------------------------------------------- gelu: fp32's (bf16's is in the GEMM)

    def gelu_forward(self, out, inp):
        self._elementwise("gelu", "gelu_forward", out, inp)

    # ---------------------------------------------------------------- classifier

    def fused_classifier(self, logits, losses, targets, V, dloss):
        # losses = logsumexp(logits[:V]) - logits[target]; dlogits = (softmax - onehot) * dloss, 0 on V..Vp.
        # Its second pass re-reads the row from L2: keeping the row in shared memory instead, to read it from
        # memory once, measured slower on an H200 (5.28 against 5.10 ms at B=64, T=1024).
        Vp = logits.shape[-1]
        N = logits.size // Vp
        check_packs((logits,), Vp=Vp)
        check_int32("targets", targets)
        write = dloss is not None
        threads = 1024   # two blocks an SM (classifier.cu); 512 took 6.32 against 4.93 ms on an H100
        self._kernel("classifier", "fused_classifier", THREADS=threads)(
            (N,), (threads,), (logits, losses, targets, np.float32(dloss if write else 0.0), np.int32(write),
                            np.int32(V), np.int32(Vp)))

    # ---------------------------------------------------------------- optimizer

    def adamw(self, param, grad, m, v, master, lr, beta1, beta2, eps, weight_decay, t, grad_scale):
        n = param.size
        c1, c2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
        f32 = np.float32
        if grad_scale.dtype != FP32 or grad_scale.shape != ():
            raise ValueError(f"adamw's grad_scale is a 0-d float32 device array, got {grad_scale.dtype} "
                             f"{grad_scale.shape}")
        # adamw.cu's groups of four: m lies lead elements past a 16-byte boundary, the fp32 arrays alike,
        # and quads when the parameter and its gradient are aligned as they are
        lead = m.data.ptr // 4 % 4
        if len({x.data.ptr % 16 for x in (m, v, master) if x is not None}) != 1:
            raise ValueError("adamw's m, v and master must start at the same offset from 16-byte boundaries")
        quads = all((x.data.ptr - lead * x.itemsize) % (4 * x.itemsize) == 0 for x in (param, grad))
        self._kernel("adamw", "adamw")(
            (blocks(-(-(n + lead) // 4)),), (BLOCK,),
            (param, grad, m, v, master, n, np.int32(lead), np.int32(quads), f32(lr), f32(beta1), f32(beta2),
             f32(c1), f32(c2), f32(eps), f32(weight_decay), grad_scale))

    def sumsq(self, x):
        """sum(x^2) in fp32 as a 0-d device array: fixed-size partial sums, then one block adds them."""
        parts = 4 * self.num_sms
        partial = self._buffer("sumsq_partial", (parts,), FP32)
        out = cupy.empty((), dtype=FP32)
        self._kernel("reduce", "sumsq_partial", x.dtype)((parts,), (512,), (partial, x, x.size))
        self._kernel("reduce", "sumsq_final", x.dtype)((1,), (512,), (out, partial, np.int32(parts)))
        return out
