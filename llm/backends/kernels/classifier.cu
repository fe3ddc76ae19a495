// The fused classifier: softmax over the first V of the Vp logits of each row, the cross-entropy loss,
// and (when asked) dlogits = (probs - onehot(target)) * dloss written over the logits, in one launch.
#include "common.cuh"

// One block of THREADS threads per row (B*T rows). Pass 1: each thread keeps an online softmax (max,
// sum, common.cuh) over every THREADS-th pack of the row's first V columns; the warps combine theirs with
// shuffles, then every warp combines the warps' pairs by the same five shuffle steps and takes its lane
// 0's, so that the block shares one (m, s). (A loop over the warps' pairs in every thread took 64
// exponentials a thread, more than its packs.)
// losses[row] = log(sum) + max - logit[target].
// Pass 2, only when write_dlogits is set: overwrite the row with (probs - onehot) * dloss over the first V
// columns and 0 over the padding V..Vp.
// Pass 2 re-reads a row pass 1 has just read, so it mostly hits the L2 cache. Both passes take the packs
// wholly inside the first V columns on a path without per-value bounds, which is all but one pack a row.
//
// Two blocks per SM, 2048 threads, which leaves each at most 32 registers: every thread the SM can hold keeps
// loads in flight (at 38 registers, one block a SM).
#ifndef THREADS
#define THREADS 1024   // threads per block: the launcher launches the same number
#endif
extern "C" __global__ void __launch_bounds__(THREADS, 2)
fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int write_dlogits, int V,
                 int Vp) {
    __shared__ float warp_m[32], warp_s[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    floatX* x = logits + (long long)blockIdx.x * Vp;
    const int target = targets[blockIdx.x];
    const float target_logit = (float)x[target];  // read before any thread overwrites the row
    float m = LOWEST, s = 0.0f;
    #pragma unroll 4   // several loads in flight per thread
    for (int c = threadIdx.x * PACK; c < V; c += THREADS * PACK) {
        const Pack p = load_pack(x + c);
        if (c + PACK <= V) softmax_fold_pack(&m, &s, p, PACK);
        else softmax_fold_pack(&m, &s, p, V - c);
    }
    warp_softmax_combine(&m, &s);
    if (lane == 0) {
        warp_m[warp] = m;
        warp_s[warp] = s;
    }
    __syncthreads();
    // every warp combines the warps' (m, s) alike, and takes its lane 0's: one (m, s) for the whole block
    m = lane < THREADS / 32 ? warp_m[lane] : LOWEST;
    s = lane < THREADS / 32 ? warp_s[lane] : 0.0f;
    warp_softmax_combine(&m, &s);
    m = __shfl_sync(0xffffffffu, m, 0);
    s = __shfl_sync(0xffffffffu, s, 0);
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(s) + m - target_logit;
    if (!write_dlogits) return;
    // prob = exp(x - m) / s = 2^(x log2(e) - shift)
    const float shift = m * LOG2E + log2f(s);
    #pragma unroll 4
    for (int c = threadIdx.x * PACK; c < Vp; c += THREADS * PACK) {
        Pack p = load_pack(x + c);
        if (c + PACK <= V) {
            #pragma unroll
            for (int i = 0; i < PACK; i++)
                p.v[i] = floatX(fast_exp2(fmaf((float)p.v[i], LOG2E, -shift)) * dloss);
        } else {
            #pragma unroll
            for (int i = 0; i < PACK; i++)
                p.v[i] = floatX(c + i < V ? fast_exp2(fmaf((float)p.v[i], LOG2E, -shift)) * dloss : 0.0f);
        }
        store_pack(x + c, p);
    }
    // the target's column, (prob - 1) * dloss, by the thread that wrote its pack, after it: the same
    // thread's two stores to one address land in program order
    if (threadIdx.x == target / PACK % THREADS)
        x[target] = floatX((fast_exp2(fmaf(target_logit, LOG2E, -shift)) - 1.0f) * dloss);
}
