// The squared global gradient norm: sum of x^2 in float over a 1-D array, in two deterministic stages.
#include "common.cuh"

// Stage 1: gridDim.x blocks stride over x, thread i taking elements i, i + gridDim.x * blockDim.x, ...
// (element-wise loads: the array may start anywhere). Each block writes the sum of its threads' sums
// to partial[blockIdx.x].
extern "C" __global__ void sumsq_partial(float* partial, const floatX* x, long long n) {
    float acc = 0.0f;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = (float)x[i];
        acc += v * v;
    }
    acc = block_sum(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Stage 2: one block adds the `parts` partial sums; thread j takes partials j, j + blockDim.x, ...
extern "C" __global__ void sumsq_final(float* out, const float* partial, int parts) {
    float acc = 0.0f;
    for (int j = threadIdx.x; j < parts; j += blockDim.x) acc += partial[j];
    acc = block_sum(acc);
    if (threadIdx.x == 0) *out = acc;
}
