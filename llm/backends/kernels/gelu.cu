// GELU forward, element-wise (the math is in gelu.cuh): fp32's. In bf16 the forward GEMM's epilogue applies
// GELU, and the backward's pass (matmul.cu) takes the gradient through it.
#include "common.cuh"
#include "gelu.cuh"

// One thread per pack: n/PACK threads.
extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n) {
    const long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (idx >= n) return;
    const Pack x = load_pack(inp + idx);
    Pack y;
    for (int i = 0; i < PACK; i++) {
        const float v = (float)x.v[i];
        y.v[i] = floatX(gelu(v, gelu_tanh(v)));
    }
    store_pack(out + idx, y);
}
