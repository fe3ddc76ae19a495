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

// One thread per element: n threads. Segments can start anywhere (ZeRO shards), so no packs here.
extern "C" __global__ void adamw(floatX* param, const floatX* grad, float* m, float* v, float* master,
                                 long long n, float lr, float beta1, float beta2, float c1, float c2,
                                 float eps, float weight_decay, const float* grad_scale) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const float scale = *grad_scale;
    if (i >= n || isnan(scale)) return;
    const float g = scale * (float)grad[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p_old = master != nullptr ? master[i] : (float)param[i];
    const float p = p_old - lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + weight_decay * p_old);
    if (master != nullptr) master[i] = p;
    param[i] = floatX(p);
}
