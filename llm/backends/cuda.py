"""The GPU plumbing under the cupy backend: compiled kernels, scratch buffers, cuBLAS's and cuBLASLt's GEMMs.

cupy_backend.py launches the ops; this file holds what every launcher needs and no op of its own.

Kernels: each kernels/<family>.cu is compiled with cupy.RawModule once per element type (floatX, set by
-DFLOATX) and per set of defines its launcher passes (tile sizes, head size). Kernels that move 16-byte
packs need the row lengths they step over (C, T, hs, Vp) to be multiples of 8 and 16-byte aligned
arrays; check_packs says so in one line when they are not.

cuBLAS is column-major; our arrays are row-major. A row-major (R, K) array is, in cuBLAS's eyes, the
column-major K x R matrix: its transpose. So out = inp @ w^T, row-major (N, OC), is computed as the
column-major out^T (OC x N) = w (OC x C) @ inp^T (C x N). cuBLAS sees w's memory as w^T, so w goes in
with op T, and inp's memory as inp^T, so inp goes in as is: gemm(T, N, m=OC, n=N, k=C). Each caller
spells its own mapping.
"""
import ctypes
import importlib.resources

import numpy as np

import cupy
import ml_dtypes
from cupy_backends.cuda.libs import cublas   # loads libcublas: import this module only once a GPU is known

KERNELS = importlib.resources.files(__package__) / "kernels"
COMMON_INCLUDE = '#include "common.cuh"'
BF16 = np.dtype(ml_dtypes.bfloat16)
FP32 = np.dtype(np.float32)
CTYPES = {BF16: "__nv_bfloat16", FP32: "float"}
CUDA_TYPES = {BF16: cupy.cuda.runtime.CUDA_R_16BF, FP32: cupy.cuda.runtime.CUDA_R_32F}
PACK_MULTIPLE = 8    # elements in a 16-byte pack of bf16 (4 for fp32; 8 covers both)
BLOCK = 256          # threads per block for the element-wise kernels


def blocks(n, per_block=BLOCK):
    """Blocks of per_block threads (or items) that cover n."""
    return (n + per_block - 1) // per_block


def check_packs(arrays, **lengths):
    """Kernels that move 16-byte packs need 16-byte aligned arrays and lengths that are multiples of 8."""
    for what, value in lengths.items():
        if value % PACK_MULTIPLE:
            raise ValueError(f"the cupy backend needs {what} to be a multiple of {PACK_MULTIPLE}, got {value}")
    if any(a.data.ptr % 16 for a in arrays):
        raise ValueError("the cupy backend needs arrays that start on a 16-byte boundary "
                         "(views at element offsets that are multiples of 8)")


def check_int32(name, a):
    if a.dtype != np.int32:
        raise TypeError(f"the cupy backend needs {name} as an int32 array, got {a.dtype}")


class Kernels:
    """kernels.get(family, name, dtype, **defines): the kernel `name` of kernels/<family>.cu, compiled for
    element type dtype and with -DNAME=value for each define.

    A launcher passes here every constant its launch depends on (tiles, warps, head size), so that the
    .cu's #ifndef values are defaults only and a grid can never disagree with the code it launches. Each
    (family, dtype, defines) is one module, compiled on first use (CuPy keeps a disk cache)."""

    def __init__(self):
        self._modules, self._kernels = {}, {}

    def get(self, family, name, dtype, **defines):
        module = (family, np.dtype(dtype), tuple(sorted(defines.items())))
        if (module, name) not in self._kernels:
            if module not in self._modules:
                # common.cuh is pasted in rather than found on an include path, so that CuPy's compile
                # cache, keyed on the source text, sees any change to it.
                source = (KERNELS / f"{family}.cu").read_text()
                source = source.replace(COMMON_INCLUDE, (KERNELS / "common.cuh").read_text())
                options = (f"-DFLOATX={CTYPES[module[1]]}",) + tuple(f"-D{k}={v}" for k, v in module[2])
                self._modules[module] = cupy.RawModule(code=source, options=options)
            self._kernels[module, name] = self._modules[module].get_function(name)
        return self._kernels[module, name]


class Scratch:
    """Named scratch buffers kept between calls; one is reallocated only when its shape or dtype changes."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, shape, dtype):
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            buf = self._buffers[name] = cupy.empty(shape, dtype=dtype)
        return buf

    def buffers(self):
        return list(self._buffers.values())


class Blas:
    """cuBLAS GEMMs on CuPy arrays with fp32 accumulation (TF32 for fp32 inputs when allowed)."""

    OPS = {"N": cublas.CUBLAS_OP_N, "T": cublas.CUBLAS_OP_T}

    def __init__(self, allow_tf32):
        self.fp32_compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if allow_tf32 else cublas.CUBLAS_COMPUTE_32F
        self._scalars = {}

    def _host_scalar(self, value):
        """A float32 on the host that cuBLAS reads alpha or beta from; cached so it outlives the call."""
        if value not in self._scalars:
            self._scalars[value] = np.array(value, dtype=np.float32)
        return self._scalars[value].ctypes.data

    def gemm(self, transa, transb, m, n, k, A, lda, B, ldb, C, ldc, alpha=1.0, beta=0.0,
             batch=1, stride_a=0, stride_b=0, stride_c=0):
        """C = alpha op(A) op(B) + beta C, column-major (m x n) = (m x k)(k x n); batched when batch > 1."""
        handle = cupy.cuda.device.get_cublas_handle()
        compute = self.fp32_compute if A.dtype == FP32 else cublas.CUBLAS_COMPUTE_32F
        alpha, beta = self._host_scalar(alpha), self._host_scalar(beta)
        a_type, b_type, c_type = CUDA_TYPES[A.dtype], CUDA_TYPES[B.dtype], CUDA_TYPES[C.dtype]
        if batch == 1:
            cublas.gemmEx(handle, self.OPS[transa], self.OPS[transb], m, n, k, alpha, A.data.ptr, a_type, lda,
                          B.data.ptr, b_type, ldb, beta, C.data.ptr, c_type, ldc, compute, cublas.CUBLAS_GEMM_DEFAULT)
        else:
            cublas.gemmStridedBatchedEx(handle, self.OPS[transa], self.OPS[transb], m, n, k, alpha,
                                        A.data.ptr, a_type, lda, stride_a, B.data.ptr, b_type, ldb, stride_b,
                                        beta, C.data.ptr, c_type, ldc, stride_c, batch,
                                        compute, cublas.CUBLAS_GEMM_DEFAULT)


class BlasLt:
    """cuBLASLt's matmul through ctypes (CuPy wraps only cuBLAS): a GEMM whose epilogue adds a bias, applies
    GELU and keeps its input (GELU_AUX_BIAS), or multiplies by GELU's derivative (DGELU), inside the GEMM
    itself, so the Linear layers' bias and GELU cost no separate pass over memory (llm.c's gelu_fusion).

    lt.matmul(...) computes D = alpha op(A) op(B) + beta D, column-major (m x n), as Blas.gemm. A plan (the
    operation, the matrix layouts and the algorithm cuBLASLt's heuristic picks) is made once per shape."""

    # enum values from cublasLt.h
    TRANSA, TRANSB, EPILOGUE, BIAS_POINTER, AUX_POINTER, AUX_LD = 3, 4, 7, 8, 11, 12
    EPILOGUES = {"none": 1, "bias": 4, "gelu_aux_bias": 32 | 128 | 4, "dgelu": 64 | 128}
    MAX_WORKSPACE, MIN_ALIGNMENTS = 1, (5, 6, 7, 8)   # preferences: workspace, A, B, C, D alignment in bytes
    WORKSPACE = 32 << 20

    class Heuristic(ctypes.Structure):   # cublasLtMatmulHeuristicResult_t
        _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                    ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]

    def __init__(self, allow_tf32):
        self.lib = self._load()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.fp32_compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if allow_tf32 else cublas.CUBLAS_COMPUTE_32F
        self.workspace = cupy.empty(self.WORKSPACE, cupy.uint8)
        self.plans = {}
        self.scalars = {v: np.array(v, np.float32) for v in (0.0, 1.0)}

    @staticmethod
    def _load():
        for name in ("libcublasLt.so.13", "libcublasLt.so.12"):   # already loaded with CuPy's cuBLAS
            try:
                return ctypes.CDLL(name)
            except OSError:
                pass
        from cuda import pathfinder
        return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cublasLt").abs_path)

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _set(self, desc, attribute, value):
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value),
                                                            ctypes.c_size_t(ctypes.sizeof(value))),
                    "cublasLtMatmulDescSetAttribute")

    def _layout(self, dtype, rows, cols, ld):
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_TYPES[dtype], ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def _plan(self, key):
        if key not in self.plans:
            transa, transb, m, n, k, lda, ldb, ldc, a_type, b_type, d_type, epilogue, aux_ld = key
            desc = ctypes.c_void_p()
            compute = self.fp32_compute if a_type == FP32 else cublas.CUBLAS_COMPUTE_32F
            self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), compute, CUDA_TYPES[FP32]),
                        "cublasLtMatmulDescCreate")
            self._set(desc, self.TRANSA, ctypes.c_int32(Blas.OPS[transa]))
            self._set(desc, self.TRANSB, ctypes.c_int32(Blas.OPS[transb]))
            self._set(desc, self.EPILOGUE, ctypes.c_uint32(self.EPILOGUES[epilogue]))
            if aux_ld:
                self._set(desc, self.AUX_LD, ctypes.c_int64(aux_ld))
            layouts = (self._layout(a_type, *((m, k) if transa == "N" else (k, m)), lda),
                       self._layout(b_type, *((k, n) if transb == "N" else (n, k)), ldb),
                       self._layout(d_type, m, n, ldc))
            # Views into the flat buffers (a layer's weights, its bias) are 16-byte aligned, not 256 as
            # cuBLASLt assumes unless told; the heuristic also reads the bias and aux pointers' alignment.
            preference = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "PreferenceCreate")
            for attribute, value in ((self.MAX_WORKSPACE, ctypes.c_size_t(self.WORKSPACE)),
                                     *((a, ctypes.c_uint32(16)) for a in self.MIN_ALIGNMENTS)):
                self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                    preference, attribute, ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value))),
                    "PreferenceSetAttribute")
            for attribute in self._pointers(epilogue):
                self._set(desc, attribute, ctypes.c_void_p(16))
            result, found = self.Heuristic(), ctypes.c_int(0)
            self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2],
                                                                layouts[2], preference, 1, ctypes.byref(result),
                                                                ctypes.byref(found)), "AlgoGetHeuristic")
            if found.value == 0:
                raise RuntimeError(f"cuBLASLt has no algorithm for the matmul {key}")
            self.plans[key] = (desc, layouts, result)
        return self.plans[key]

    def _pointers(self, epilogue):
        """The pointers an epilogue reads or writes, in the order (bias, aux); the others must stay NULL."""
        return {"none": (), "bias": (self.BIAS_POINTER,), "gelu_aux_bias": (self.BIAS_POINTER, self.AUX_POINTER),
                "dgelu": (self.AUX_POINTER,)}[epilogue]

    def matmul(self, transa, transb, m, n, k, A, lda, B, ldb, D, ldc, beta=0.0, epilogue="none", bias=None,
               aux=None, aux_ld=0):
        """D = op(A) op(B) + beta D, then the epilogue: "bias" adds bias (m), "gelu_aux_bias" adds bias,
        writes the sum to aux and its GELU to D, "dgelu" multiplies by GELU's derivative at aux."""
        desc, (a_layout, b_layout, d_layout), result = self._plan(
            (transa, transb, m, n, k, lda, ldb, ldc, A.dtype, B.dtype, D.dtype, epilogue, aux_ld))
        for attribute, array in zip(self._pointers(epilogue), [x for x in (bias, aux) if x is not None]):
            self._set(desc, attribute, ctypes.c_void_p(array.data.ptr))
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, self.scalars[1.0].ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(A.data.ptr),
            a_layout, ctypes.c_void_p(B.data.ptr), b_layout, self.scalars[beta].ctypes.data_as(ctypes.c_void_p),
            ctypes.c_void_p(D.data.ptr), d_layout, ctypes.c_void_p(D.data.ptr), d_layout, ctypes.byref(result.algo),
            ctypes.c_void_p(self.workspace.data.ptr), ctypes.c_size_t(self.WORKSPACE),
            ctypes.c_void_p(cupy.cuda.get_current_stream().ptr)), "cublasLtMatmul")
