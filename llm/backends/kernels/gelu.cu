// GELU, tanh approximation (GPT-2's): y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
#include "common.cuh"

#define GELU_SCALE 0.7978845608028654f  // sqrt(2 / pi)

// One thread per pack: n/PACK threads.
extern "C" __global__ void gelu_forward(floatX* out, const floatX* inp, long long n) {
    const long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (idx >= n) return;
    const Pack x = load_pack(inp + idx);
    Pack y;
    for (int i = 0; i < PACK; i++) {
        const float v = (float)x.v[i];
        y.v[i] = floatX(0.5f * v * (1.0f + tanhf(GELU_SCALE * (v + 0.044715f * v * v * v))));
    }
    store_pack(out + idx, y);
}

// dinp = dout * dy/dx, dy/dx = 0.5 (1 + tanh u) + 0.5 x sech^2(u) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// dinp is overwritten. One thread per pack: n/PACK threads.
extern "C" __global__ void gelu_backward(floatX* dinp, const floatX* inp, const floatX* dout, long long n) {
    const long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (idx >= n) return;
    const Pack x = load_pack(inp + idx), d = load_pack(dout + idx);
    Pack dx;
    for (int i = 0; i < PACK; i++) {
        const float v = (float)x.v[i];
        const float th = tanhf(GELU_SCALE * (v + 0.044715f * v * v * v));
        const float grad = 0.5f * (1.0f + th)
                           + 0.5f * v * (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * v * v);
        dx.v[i] = floatX(grad * (float)d.v[i]);
    }
    store_pack(dinp + idx, dx);
}
