// Deterministic sums in two stages, with no atomics: blocks write partial sums, then the partials are added
// in a fixed order, so a sum is the same on every run.
//   add_partial_sums   the second stage of the bias and layernorm weight gradients (matmul.cu, layernorm.cu)
//   sumsq_partial/final   sum of x^2 in float over a 1-D array: the squared global gradient norm
#include "common.cuh"

// The partial sums of `count` outputs side by side, each n long: partial (rows, count * n). For
// j < count * n, output j / n gets, at j % n, the sum over k < rows of partial[k * count * n + j].
// Block (32, ADD_PHASES) takes 32 columns: thread (x, y) adds rows y, y + ADD_PHASES, ... of column x (a warp
// reads 128 contiguous bytes of a row), then thread (x, 0) adds the ADD_PHASES sums in order. The order is
// fixed, so the sums are the same on every run; one launch for all of a layernorm's sums. A thread used to
// take a whole column alone: 132 rows one after another, 7.0 us for a layernorm's sums at d12 or d48, now
// 5.2-5.5 (H100).
#ifndef ADD_PHASES
#define ADD_PHASES 32
#endif
extern "C" __global__ void __launch_bounds__(32 * ADD_PHASES)
add_partial_sums(floatX* out0, floatX* out1, floatX* out2, const float* partial, int rows, int n, int count) {
    __shared__ float sums[ADD_PHASES][32];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (j < count * n)
        #pragma unroll 8
        for (int k = threadIdx.y; k < rows; k += ADD_PHASES) acc += partial[(long long)k * count * n + j];
    sums[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y > 0 || j >= count * n) return;
    float total = 0.0f;
    for (int y = 0; y < ADD_PHASES; y++) total += sums[y][threadIdx.x];
    floatX* out = j < n ? out0 : j < 2 * n ? out1 : out2;
    out[j % n] = floatX((float)out[j % n] + total);
}

// sumsq, stage 1: gridDim.x blocks stride over x, thread i taking packs i, i + gridDim.x * blockDim.x, ...
// The array may start anywhere (a ZeRO shard), so the elements before its first 16-byte boundary and
// those after its last whole pack are read one at a time. Each block writes the sum of its threads'
// sums to partial[blockIdx.x].
extern "C" __global__ void sumsq_partial(float* partial, const floatX* x, long long n) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x,
                    stride = (long long)gridDim.x * blockDim.x;
    const long long head = min(n, (long long)((16 - (size_t)x % 16) % 16 / sizeof(floatX)));
    const long long packs = (n - head) / PACK, tail = head + packs * PACK;
    float acc = 0.0f;
    for (long long p = tid; p < packs; p += stride) {
        const Pack v = load_pack(x + head + p * PACK);
        for (int i = 0; i < PACK; i++) acc += (float)v.v[i] * (float)v.v[i];
    }
    for (long long i = tid; i < head; i += stride) acc += (float)x[i] * (float)x[i];
    for (long long i = tail + tid; i < n; i += stride) acc += (float)x[i] * (float)x[i];
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// sumsq, stage 2: one block adds the `parts` partial sums; thread j takes partials j, j + blockDim.x, ...
extern "C" __global__ void sumsq_final(float* out, const float* partial, int parts) {
    float acc = 0.0f;
    for (int j = threadIdx.x; j < parts; j += blockDim.x) acc += partial[j];
    acc = block_sum(acc);
    if (threadIdx.x == 0) *out = acc;
}
