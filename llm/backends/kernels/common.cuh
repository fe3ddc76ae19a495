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

// A butterfly sum over the 32 lanes of a warp; every lane gets the result, and the order of
// the additions is fixed, so the result is the same on every run.
__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// The online softmax (Milakov and Gimelshein, 2018): one pass over a row keeps a running max m and a running
// sum s = sum of exp(x - m) over the values seen so far. When a larger max m' arrives, the sum so far is
// rescaled by exp(m - m'), so at the end s is exactly sum exp(x - max): no approximation, one read of the
// row. Two partial (m, s) pairs, over disjoint parts of a row, combine the same way. The classifier and
// attention both reduce their rows with these.
__device__ __forceinline__ void softmax_combine(float* m, float* s, float m2, float s2) {
    const float new_m = fmaxf(*m, m2);
    *s = *s * __expf(*m - new_m) + s2 * __expf(m2 - new_m);
    *m = new_m;
}

// 2^x by the special-function unit in one instruction (exp2f without fast math adds range handling);
// ex2.approx(-inf) = 0, which is what the causal mask relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// exp(x - m) = 2^(x log2(e) - m log2(e)): one fused multiply-add and one ex2 per value, with m log2(e)
// computed once for many values.
constexpr float LOG2E = 1.4426950408889634f;

// Fold the first n values of a pack (those before the row's end) into a running (m, s). The sum is
// rescaled only when the pack holds a new max, which stops happening once the row's largest values have
// been seen: one exponential per value, not one more per pack.
__device__ __forceinline__ void softmax_fold_pack(float* m, float* s, const Pack& p, int n) {
    float pack_max = LOWEST;
    #pragma unroll
    for (int i = 0; i < PACK; i++) if (i < n) pack_max = fmaxf(pack_max, (float)p.v[i]);
    if (pack_max > *m) {
        *s *= fast_exp2((*m - pack_max) * LOG2E);
        *m = pack_max;
    }
    const float m_log2 = *m * LOG2E;
    #pragma unroll
    for (int i = 0; i < PACK; i++) if (i < n) *s += fast_exp2(fmaf((float)p.v[i], LOG2E, -m_log2));
}

// Combine the (m, s) of the 32 lanes of a warp; every lane gets the row's (max, sum).
__device__ __forceinline__ void warp_softmax_combine(float* m, float* s) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, *m, offset),
                    s2 = __shfl_xor_sync(0xffffffffu, *s, offset);
        softmax_combine(m, s, m2, s2);
    }
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
