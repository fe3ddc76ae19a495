// The part of a Linear layer that cuBLAS does not do: the bias gradient in the backward (cuBLASLt's epilogue
// adds the bias in the forward). Its per-block partial sums are added up by reduce.cu's add_partial_sums.
// Built for fp32 as well, it adds up the partial column sums of dqkv that flash attention's backward writes.
#include "common.cuh"
#include "gelu.cuh"

// Column sums of dout (N, OC) in float, first stage. Blocks of (32, 8) threads: threadIdx.x and blockIdx.x
// pick a pack of columns (32 packs per block), and the 8 * gridDim.y threads (threadIdx.y, blockIdx.y)
// split the rows, thread y taking rows y, y + 8 * gridDim.y, ... The block adds its 8 rows of sums in
// order and writes row blockIdx.y of partial (gridDim.y, OC).
//
// With pre_gelu given, dout is the gradient at a GELU's output (the MLP's: fcproj's input gradient) and is
// first taken back through the GELU in place, dout *= gelu'(pre_gelu), so that the sums are the bias
// gradient of the layer that made pre_gelu (fc). With gelu_out given as well, gelu_out = GELU(pre_gelu)
// from the same read: -r 1's recompute, which fcproj's weight gradient needs next. One pass over the
// MLP's widest tensors does all three.
//
// The launcher makes gridDim.y as large as one wave of blocks allows, BLOCKS_PER_SM an SM (which the launch
// bounds make fit), and no larger: every block then runs from the start, none is left over for a second,
// nearly empty wave.
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 4
#endif
extern "C" __global__ void __launch_bounds__(256, BLOCKS_PER_SM)
bias_backward_partial(float* partial, floatX* dout, int N, int OC, const floatX* pre_gelu, floatX* gelu_out) {
    __shared__ float sums[8][PACK][32];
    const int c = (blockIdx.x * 32 + threadIdx.x) * PACK;
    float acc[PACK] = {};
    if (c < OC) {
        #pragma unroll 4
        for (int r = blockIdx.y * 8 + threadIdx.y; r < N; r += gridDim.y * 8) {
            const long long at = (long long)r * OC + c;
            Pack d = load_pack(dout + at);
            if (pre_gelu) {
                const Pack x = load_pack(pre_gelu + at);
                Pack y;
                for (int i = 0; i < PACK; i++) {
                    const float v = (float)x.v[i], th = gelu_tanh(v);   // gelu and gelu_grad share it
                    d.v[i] = floatX(gelu_grad(v, th) * (float)d.v[i]);
                    y.v[i] = floatX(gelu(v, th));
                }
                store_pack(dout + at, d);
                if (gelu_out) store_pack(gelu_out + at, y);
            }
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
