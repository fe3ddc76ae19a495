// AdamW over one contiguous segment of the flat buffers, as llm.c's adamw kernel:
//   g = grad_scale * grad;  m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
//   p = p_old - lr * ((m / c1) / (sqrt(v / c2) + eps) + weight_decay * p_old)
//   c1 = 1 - beta1^t, c2 = 1 - beta2^t
// p_old is the fp32 master weight when there is one, else the parameter itself. The new value goes to the
// master (if any) and is rounded to the nearest floatX (ties to even) into the parameter; llm.c rounds
// stochastically instead, which only changes the low bit now and then.
// grad_scale, the clipping factor, is read from device memory, where the step computed it from the norm
// (llm/zero.py:clip_scale), so the update is queued before the host knows the norm. NaN, for a step whose
// loss or norm is not finite, leaves everything as it is.
#include "common.cuh"

struct Hyper {
    float lr, beta1, beta2, c1, c2, eps, weight_decay, scale;
};

// One element: updates m and v in place and returns the new parameter.
__device__ __forceinline__ float adamw_element(float grad, float* m, float* v, float p_old, const Hyper& h) {
    const float g = h.scale * grad;
    *m = h.beta1 * *m + (1.0f - h.beta1) * g;
    *v = h.beta2 * *v + (1.0f - h.beta2) * g * g;
    return p_old - h.lr * ((*m / h.c1) / (sqrtf(*v / h.c2) + h.eps) + h.weight_decay * p_old);
}

// Four elements a thread, so that each array moves in words of four: 1.164 ms at d12 (124M parameters) on
// an H100, 3.0 TB/s, against 1.256 for one element a thread. Segments start anywhere (ZeRO shards, the
// decay segments), so thread j takes elements 4j - lead ... + 3, where lead (< 4, from the launcher) is how
// far m lies past a 16-byte boundary: the groups then sit on the buffer's own 16-byte words, and a warp's on
// its 512-byte lines (with every group one off, 1.227 ms). m, v and the master start at the same offset of
// buffers that the launcher checks are aligned alike, so every group but the first and the last is aligned
// for all three; those two go element by element. The parameter and its gradient sit at the same offset
// too, except in a ZeRO shard that starts elsewhere in its buffer: then (quads = 0) they are read and
// written element by element.
struct alignas(4 * sizeof(floatX)) Quad {
    floatX v[4];
};
__device__ __forceinline__ Quad load_quad(const floatX* p, int aligned) {
    if (aligned) return *(const Quad*)p;
    Quad x;
    for (int k = 0; k < 4; k++) x.v[k] = p[k];
    return x;
}
__device__ __forceinline__ void store_quad(floatX* p, const Quad& x, int aligned) {
    if (aligned) *(Quad*)p = x;
    else for (int k = 0; k < 4; k++) p[k] = x.v[k];
}

extern "C" __global__ void adamw(floatX* param, const floatX* grad, float* m, float* v, float* master,
                                 long long n, int lead, int quads, float lr, float beta1, float beta2,
                                 float c1, float c2, float eps, float weight_decay, const float* grad_scale) {
    const Hyper h = {lr, beta1, beta2, c1, c2, eps, weight_decay, *grad_scale};
    const long long first = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x) - lead;
    if (first >= n || isnan(h.scale)) return;
    if (first < 0 || first + 4 > n) {   // the segment's ragged ends
        for (long long i = max(first, 0ll); i < min(first + 4, n); i++) {
            const float p = adamw_element((float)grad[i], &m[i], &v[i],
                                          master != nullptr ? master[i] : (float)param[i], h);
            if (master != nullptr) master[i] = p;
            param[i] = floatX(p);
        }
        return;
    }
    const Quad g4 = load_quad(grad + first, quads);
    Quad p4;
    if (master == nullptr) p4 = load_quad(param + first, quads);
    float4 m4 = *(float4*)(m + first), v4 = *(float4*)(v + first);
    float4 old = master != nullptr ? *(float4*)(master + first)
                                   : make_float4(p4.v[0], p4.v[1], p4.v[2], p4.v[3]);
    float* mk = &m4.x;
    float* vk = &v4.x;
    float* pk = &old.x;
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        pk[k] = adamw_element((float)g4.v[k], &mk[k], &vk[k], pk[k], h);
        p4.v[k] = floatX(pk[k]);
    }
    *(float4*)(m + first) = m4;
    *(float4*)(v + first) = v4;
    if (master != nullptr) *(float4*)(master + first) = old;
    store_quad(param + first, p4, quads);
}
