// The residual connection: out = inp1 + inp2.
#include "common.cuh"

// One thread per pack: n/PACK threads.
extern "C" __global__ void residual_forward(floatX* out, const floatX* inp1, const floatX* inp2,
                                            long long n) {
    const long long idx = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * PACK;
    if (idx >= n) return;
    const Pack a = load_pack(inp1 + idx), b = load_pack(inp2 + idx);
    Pack o;
    for (int i = 0; i < PACK; i++) o.v[i] = floatX((float)a.v[i] + (float)b.v[i]);
    store_pack(out + idx, o);
}
