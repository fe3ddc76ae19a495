// The part of a Linear layer that cuBLAS does not do: the bias gradient in the backward (cuBLASLt's epilogue
// adds the bias in the forward). Its per-block partial sums are added up by reduce.cu's add_partial_sums.
#include "common.cuh"

// Column sums of dout (N, OC) in float, first stage. Blocks of (32, 8) threads: threadIdx.x and blockIdx.x
// pick a pack of columns (32 packs per block), and the 8 * gridDim.y threads (threadIdx.y, blockIdx.y)
// split the rows, thread y taking rows y, y + 8 * gridDim.y, ... The block adds its 8 rows of sums in
// order and writes row blockIdx.y of partial (gridDim.y, OC).
extern "C" __global__ void bias_backward_partial(float* partial, const floatX* dout, int N, int OC) {
    __shared__ float sums[8][PACK][32];
    const int c = (blockIdx.x * 32 + threadIdx.x) * PACK;
    float acc[PACK] = {};
    if (c < OC) {
        for (int r = blockIdx.y * 8 + threadIdx.y; r < N; r += gridDim.y * 8) {
            const Pack d = load_pack(dout + (long long)r * OC + c);
            for (int i = 0; i < PACK; i++) acc[i] += (float)d.v[i];
        }
    }
    for (int i = 0; i < PACK; i++) sums[threadIdx.y][i][threadIdx.x] = acc[i];
    __syncthreads();
    if (threadIdx.y == 0 && c < OC) {
        for (int i = 0; i < PACK; i++) {
            float total = 0.0f;
            for (int y = 0; y < 8; y++) total += sums[y][i][threadIdx.x];
            partial[(long long)blockIdx.y * OC + c + i] = total;
        }
    }
}
