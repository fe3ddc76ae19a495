"""The GPU plumbing under the cupy backend: compiled kernels, scratch buffers and cuBLAS's GEMM.

cupy_backend.py launches the ops; this file holds what every launcher needs and no op of its own.

Kernels: each kernels/<family>.cu is compiled once per element type with cupy.RawModule, floatX set by
-DFLOATX. Kernels that move 16-byte packs need the row lengths they step over (C, T, hs, Vp) to be
multiples of 8 and 16-byte aligned arrays; check_packs says so in one line when they are not.

cuBLAS is column-major; our arrays are row-major. A row-major (R, K) array is, in cuBLAS's eyes, the
column-major K x R matrix: its transpose. So out = inp @ w^T, row-major (N, OC), is computed as the
column-major out^T (OC x N) = w (OC x C) @ inp^T (C x N). cuBLAS sees w's memory as w^T, so w goes in
with op T, and inp's memory as inp^T, so inp goes in as is: gemm(T, N, m=OC, n=N, k=C). Each caller
spells its own mapping.
"""
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
    """kernels[family, name, dtype]: the compiled kernel `name` of kernels/<family>.cu for element type dtype."""

    def __init__(self):
        self._modules, self._kernels = {}, {}

    def __getitem__(self, key):
        family, name, dtype = key
        if key not in self._kernels:
            if (family, dtype) not in self._modules:
                # common.cuh is pasted in rather than found on an include path, so that CuPy's compile
                # cache, keyed on the source text, sees any change to it.
                source = (KERNELS / f"{family}.cu").read_text()
                source = source.replace(COMMON_INCLUDE, (KERNELS / "common.cuh").read_text())
                self._modules[family, dtype] = cupy.RawModule(code=source, options=(f"-DFLOATX={CTYPES[dtype]}",))
            self._kernels[key] = self._modules[family, dtype].get_function(name)
        return self._kernels[key]


class Scratch:
    """Named scratch buffers kept between calls; one is reallocated only when its shape or dtype changes."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, shape, dtype):
        buf = self._buffers.get(name)
        if buf is None or buf.shape != tuple(shape) or buf.dtype != dtype:
            buf = self._buffers[name] = cupy.empty(shape, dtype=dtype)
        return buf


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
