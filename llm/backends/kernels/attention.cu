// Causal self-attention around cuBLAS: the head split and merge, and the causal softmax with its backward.
// The two batched products (q @ k^T scaled by 1/sqrt(hs), and att @ v) and their gradients are
// gemmStridedBatchedEx calls made by the launcher, one batch entry per (b, head).
#include "common.cuh"

// out (S, B, NH, T, hs) <- inp (B, T, S, NH, hs). With S = 3 this splits qkv (B, T, 3C) into q, k and v,
// each (B, NH, T, hs); with S = 1 it splits (B, T, C) into heads. One thread per pack of out, in out's order,
// so the writes are coalesced and each read is a contiguous run of hs.
extern "C" __global__ void permute(floatX* out, const floatX* inp, int B, int T, int S, int NH, int hs) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)S * B * NH * T * hs / PACK) return;
    const long long out_offset = idx * PACK;
    const int d = (idx % (hs / PACK)) * PACK;
    idx /= hs / PACK;
    const int t = idx % T;
    idx /= T;
    const int h = idx % NH;
    idx /= NH;
    const int b = idx % B, s = idx / B;
    store_pack(out + out_offset, load_pack(inp + ((((long long)b * T + t) * S + s) * NH + h) * hs + d));
}

// The inverse: out (B, T, S, NH, hs) <- inp (S, B, NH, T, hs). It merges the heads of att @ v into
// (B, T, C), and dq, dk, dv into dqkv. One thread per pack of out, in out's order.
extern "C" __global__ void unpermute(floatX* out, const floatX* inp, int B, int T, int S, int NH, int hs) {
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)S * B * NH * T * hs / PACK) return;
    const long long out_offset = idx * PACK;
    const int d = (idx % (hs / PACK)) * PACK;
    idx /= hs / PACK;
    const int h = idx % NH;
    idx /= NH;
    const int s = idx % S;
    idx /= S;
    const int t = idx % T, b = idx / T;
    store_pack(out + out_offset, load_pack(inp + ((((long long)s * B + b) * NH + h) * T + t) * hs + d));
}

// In place over att, (B*NH*T rows of T). Row r holds query t = r % T; for t2 <= t
// att[t2] = exp(att[t2] - max) / sum, the max and sum taken over t2 <= t only, and att[t2] = 0 for t2 > t:
// the causal mask, applied after the softmax as llm.c does. One warp per row (8 rows per 256-thread block).
// Each lane keeps an online softmax (max, sum; common.cuh) over every 32nd pack of the row, and the lanes
// combine theirs.
extern "C" __global__ void softmax_forward(floatX* att, int rows, int T) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int t = row % T;
    floatX* a = att + (long long)row * T;
    float m = LOWEST, sum = 0.0f;
    for (int c = lane * PACK; c <= t; c += 32 * PACK)
        softmax_fold_pack(&m, &sum, load_pack(a + c), t + 1 - c);
    warp_softmax_combine(&m, &sum);
    const float row_max = m, inv_sum = 1.0f / sum;
    for (int c = lane * PACK; c < T; c += 32 * PACK) {
        Pack p;
        if (c <= t) p = load_pack(a + c);
        for (int i = 0; i < PACK; i++)
            p.v[i] = floatX(c + i <= t ? __expf((float)p.v[i] - row_max) * inv_sum : 0.0f);
        store_pack(a + c, p);
    }
}

// In place over datt: with the row's probabilities a = att[row] (zero above the diagonal),
// dpreatt[t3] = a[t3] * (datt[t3] - sum_t2 a[t2] * datt[t2]), the softmax Jacobian applied to datt.
// It is 0 for t3 > t. The 1/sqrt(hs) scale is left to the matmuls that follow. One warp per row.
extern "C" __global__ void softmax_backward(floatX* datt, const floatX* att, int rows, int T) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const int t = row % T;
    const floatX* a = att + (long long)row * T;
    floatX* d = datt + (long long)row * T;
    float dot = 0.0f;
    for (int c = lane * PACK; c <= t; c += 32 * PACK) {
        const Pack pa = load_pack(a + c), pd = load_pack(d + c);
        for (int i = 0; i < PACK; i++) if (c + i <= t) dot += (float)pa.v[i] * (float)pd.v[i];
    }
    dot = warp_sum(dot);
    for (int c = lane * PACK; c < T; c += 32 * PACK) {
        Pack pa, pd;
        if (c <= t) {
            pa = load_pack(a + c);
            pd = load_pack(d + c);
        }
        for (int i = 0; i < PACK; i++)
            pd.v[i] = floatX(c + i <= t ? (float)pa.v[i] * ((float)pd.v[i] - dot) : 0.0f);
        store_pack(d + c, pd);
    }
}
