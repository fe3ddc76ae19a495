// The fused classifier: softmax over the first V of the Vp logits of each row, the cross-entropy loss,
// and (when asked) dlogits = (probs - onehot(target)) * dloss written over the logits, in one launch that
// reads each row from memory once. The launcher compiles it per padded vocab size VP: a block keeps its
// row in shared memory between the two passes, and exports how many bytes that takes.
#include "common.cuh"

#ifndef VP
#define VP 50304
#endif
#ifndef THREADS
#define THREADS 1024
#endif
constexpr int PACKS = VP / PACK;
static_assert(VP % PACK == 0, "the launcher checks that Vp is a multiple of 8");
extern "C" __device__ int fused_classifier_smem = VP * sizeof(floatX);

// One block of THREADS threads per row (B*T rows); thread t takes packs t, t + THREADS, ... Pass 1: it copies
// them into shared memory and keeps an online softmax (max, sum; common.cuh) over those of the first V
// columns; the warps combine theirs with shuffles, then every thread combines the warps' in the same order.
// losses[row] = log(sum) + max - logit[target]. Pass 2, only when write_dlogits is set: from shared memory,
// overwrite the row with (probs - onehot) * dloss over the first V columns and 0 over the padding V..Vp.
extern "C" __global__ void __launch_bounds__(THREADS)
fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int write_dlogits, int V) {
    extern __shared__ Pack row[];   // PACKS packs
    __shared__ float warp_m[THREADS / 32], warp_s[THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    floatX* x = logits + (long long)blockIdx.x * VP;
    const int target = targets[blockIdx.x];
    const float target_logit = (float)x[target];   // read before any thread overwrites the row
    float m = LOWEST, s = 0.0f;
    for (int k = threadIdx.x; k < PACKS; k += THREADS) {
        row[k] = load_pack(x + k * PACK);
        if (k * PACK < V) softmax_fold_pack(&m, &s, row[k], V - k * PACK);
    }
    warp_softmax_combine(&m, &s);
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    m = LOWEST;
    s = 0.0f;
    for (int k = 0; k < THREADS / 32; k++) softmax_combine(&m, &s, warp_m[k], warp_s[k]);   // every thread alike
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) + m - target_logit;
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    for (int k = threadIdx.x; k < PACKS; k += THREADS) {   // each thread reads back the packs it wrote
        Pack p = row[k];
        for (int i = 0; i < PACK; i++) {
            const int col = k * PACK + i;
            const float prob = __expf((float)p.v[i] - m) * inv_s;
            p.v[i] = floatX(col < V ? (prob - (col == target ? 1.0f : 0.0f)) * dloss : 0.0f);
        }
        store_pack(x + k * PACK, p);
    }
}
