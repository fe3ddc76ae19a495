// The fused classifier: softmax over the first V of the Vp logits of each row, the cross-entropy loss,
// and (when asked) dlogits = (probs - onehot(target)) * dloss written over the logits, in one launch.
#include "common.cuh"

// One block of 1024 threads per row (B*T rows). Pass 1: each thread keeps an online softmax (max, sum,
// common.cuh) over every 1024th pack of the row's first V columns; the warps combine theirs with shuffles,
// then every thread combines the warps' in the same order. losses[row] = log(sum) + max - logit[target].
// Pass 2, only when write_dlogits is set: overwrite the row with (probs - onehot) * dloss over the first V
// columns and 0 over the padding V..Vp.
// Pass 2 re-reads a row pass 1 has just read, so it mostly hits the L2 cache.
extern "C" __global__ void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss,
                                            int write_dlogits, int V, int Vp) {
    __shared__ float warp_m[32], warp_s[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    floatX* x = logits + (long long)blockIdx.x * Vp;
    const int target = targets[blockIdx.x];
    const float target_logit = (float)x[target];  // read before any thread overwrites the row
    float m = LOWEST, s = 0.0f;
    #pragma unroll 4   // several loads in flight per thread
    for (int c = threadIdx.x * PACK; c < V; c += blockDim.x * PACK)
        softmax_fold_pack(&m, &s, load_pack(x + c), V - c);
    warp_softmax_combine(&m, &s);
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    m = LOWEST;
    s = 0.0f;
    for (int k = 0; k < warps; k++)  // every thread, same order
        softmax_combine(&m, &s, warp_m[k], warp_s[k]);
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) + m - target_logit;
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    #pragma unroll 4
    for (int c = threadIdx.x * PACK; c < Vp; c += blockDim.x * PACK) {
        Pack p = load_pack(x + c);
        for (int i = 0; i < PACK; i++) {
            const int col = c + i;
            const float prob = __expf((float)p.v[i] - m) * inv_s;
            p.v[i] = floatX(col < V ? (prob - (col == target ? 1.0f : 0.0f)) * dloss : 0.0f);
        }
        store_pack(x + c, p);
    }
}
