// What every kernel family shares: the storage type, 16-byte packs and warp/block reductions.
//
// floatX is the storage type of parameters, gradients and activations. The loader compiles each
// family once per type, with -DFLOATX=__nv_bfloat16 or -DFLOATX=float. All arithmetic is in float:
// (float)x widens a bf16 exactly, and floatX(f) rounds a float to the nearest bf16 (ties to even).
#include <cuda_bf16.h>

#ifndef FLOATX
#define FLOATX __nv_bfloat16
#endif
typedef FLOATX floatX;

// One 16-byte load or store moves a Pack: 8 bf16 or 4 float. Kernels that use packs need the
// row lengths they step over (C, T, Vp, hs) to be multiples of PACK; the launcher checks this.
constexpr int PACK = 16 / sizeof(floatX);
struct alignas(16) Pack {
    floatX v[PACK];
};

__device__ __forceinline__ Pack load_pack(const floatX* p) {
    Pack out;
    *reinterpret_cast<int4*>(&out) = *reinterpret_cast<const int4*>(p);
    return out;
}

__device__ __forceinline__ void store_pack(floatX* p, const Pack& x) {
    *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}

// The most negative finite float: a running max that starts here stays finite, so exp(m - max) is
// never exp(-inf + inf).
#define LOWEST (-3.402823466e38f)

// Butterfly reductions over the 32 lanes of a warp; every lane gets the result, and the order of
// the additions is fixed, so the result is the same on every run.
__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// Sum over a block whose size is a multiple of 32: each warp reduces, then warp 0's lanes add the
// warps' sums. Every thread gets the result. Call it from all threads of the block.
__device__ float block_sum(float x) {
    __shared__ float warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    x = warp_sum(x);
    __syncthreads();  // a previous call may still be reading warp_sums
    if (lane == 0) warp_sums[warp] = x;
    __syncthreads();
    return warp_sum(lane < warps ? warp_sums[lane] : 0.0f);
}
