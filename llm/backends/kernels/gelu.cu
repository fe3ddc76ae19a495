// GELU forward and backward, element-wise (the math is in gelu.cuh).
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

// dinp = dout * gelu'(inp), dinp overwritten (it may be dout). One thread per pack: n/PACK threads.
extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, long long n) {
    const long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (idx >= n) return;
    const Pack x = load_pack(inp + idx), d = load_pack(dout + idx);
    Pack dx;
    for (int i = 0; i < PACK; i++) {
        const float v = (float)x.v[i];
        dx.v[i] = floatX(gelu_grad(v, gelu_tanh(v)) * (float)d.v[i]);
    }
    store_pack(dinp + idx, dx);
}
