// Deterministic sums in two stages, with no atomics: blocks write partial sums, then the partials are added
// in a fixed order, so a sum is the same on every run.
//   add_partial_sums   the second stage of the bias and layernorm weight gradients (matmul.cu, layernorm.cu)
//   sumsq_partial/final   sum of x^2 in float over a 1-D array: the squared global gradient norm
#include "common.cuh"

// The partial sums of `count` outputs side by side, each n long: partial (rows, count * n). For
// j < count * n, output j / n gets, at j % n, the sum over k < rows of partial[k * count * n + j], the rows
// added in order.
// One thread per output element (one launch for all of a layernorm's sums); consecutive threads read
// consecutive floats of each row.
extern "C" __global__ void add_partial_sums(floatX* out0, floatX* out1, floatX* out2, const float* partial,
                                            int rows, int n, int count) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count * n) return;
    floatX* out = j < n ? out0 : j < 2 * n ? out1 : out2;
    float acc = 0.0f;
    for (int k = 0; k < rows; k++) acc += partial[(long long)k * count * n + j];
    out[j % n] = floatX((float)out[j % n] + acc);
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
