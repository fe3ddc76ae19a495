// LayerNorm over the C channels of each of the B*T rows: out = (x - mean) * rstd * w + b, with
// rstd = 1 / sqrt(var + 1e-5) and the biased variance (divided by C), as llm.c.
#include "common.cuh"

// One warp per row, 8 rows per 256-thread block. Each lane takes every 32nd pack of the row; the row is
// read three times (sum, squared deviations, output), and the second and third reads hit the cache.
extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd, const floatX* inp,
                                             const floatX* w, const floatX* b, int N, int C) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const floatX* x = inp + (long long)row * C;
    float sum = 0.0f;
    for (int c = lane * PACK; c < C; c += 32 * PACK) {
        const Pack p = load_pack(x + c);
        for (int i = 0; i < PACK; i++) sum += (float)p.v[i];
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane * PACK; c < C; c += 32 * PACK) {
        const Pack p = load_pack(x + c);
        for (int i = 0; i < PACK; i++) sq += ((float)p.v[i] - m) * ((float)p.v[i] - m);
    }
    const float s = rsqrtf(warp_sum(sq) / C + 1e-5f);
    floatX* o = out + (long long)row * C;
    for (int c = lane * PACK; c < C; c += 32 * PACK) {
        const Pack p = load_pack(x + c), pw = load_pack(w + c), pb = load_pack(b + c);
        Pack r;
        for (int i = 0; i < PACK; i++) r.v[i] = floatX(((float)p.v[i] - m) * s * (float)pw.v[i] + (float)pb.v[i]);
        store_pack(o + c, r);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// With n = (x - mean) * rstd and g = w * dout:
//   dinp += rstd * (g - mean(g) - n * mean(g * n)),  dw += sum over rows of dout * n,  db += sum of dout.
// One warp per row (4 warps per block); block k's warps take rows 4k + warp, stepping by 4 * gridDim.x.
// Each warp adds its rows' dw and db terms into its own slice of shared memory: its lanes own disjoint
// channels, so there are no races, and the slice is laid out [i][pack] so the lanes hit distinct banks.
// At the end the block adds its warps' slices in warp order and writes one row of `partial`
// (gridDim.x, 2C: dw then db); add_partial_sums (reduce.cu) then adds the rows in order into dw and db.
// No atomics anywhere, so the sums are the same on every run.
extern "C" __global__ void layernorm_backward(floatX* dinp, float* partial, const floatX* dout,
                                              const floatX* inp, const floatX* w, const float* mean,
                                              const float* rstd, int N, int C) {
    extern __shared__ float slices[];  // (warps, 2, PACK, C / PACK)
    const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int packs = C / PACK;
    float* dw_acc = slices + warp * 2 * C;
    float* db_acc = dw_acc + C;
    for (int c = lane; c < 2 * C; c += 32) dw_acc[c] = 0.0f;
    __syncwarp();
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const long long offset = (long long)row * C;
        const float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_gn = 0.0f;
        for (int c = lane * PACK; c < C; c += 32 * PACK) {
            const Pack px = load_pack(inp + offset + c), pd = load_pack(dout + offset + c), pw = load_pack(w + c);
            for (int i = 0; i < PACK; i++) {
                const float g = (float)pw.v[i] * (float)pd.v[i];
                sum_g += g;
                sum_gn += g * ((float)px.v[i] - m) * s;
            }
        }
        const float mean_g = warp_sum(sum_g) / C, mean_gn = warp_sum(sum_gn) / C;
        for (int c = lane * PACK; c < C; c += 32 * PACK) {
            const Pack px = load_pack(inp + offset + c), pd = load_pack(dout + offset + c), pw = load_pack(w + c);
            Pack dx = load_pack(dinp + offset + c);
            for (int i = 0; i < PACK; i++) {
                const float n = ((float)px.v[i] - m) * s, d = (float)pd.v[i];
                dx.v[i] = floatX((float)dx.v[i] + s * ((float)pw.v[i] * d - mean_g - n * mean_gn));
                dw_acc[i * packs + c / PACK] += d * n;
                db_acc[i * packs + c / PACK] += d;
            }
            store_pack(dinp + offset + c, dx);
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < 2 * C; j += blockDim.x) {
        const int half = j / C, ch = j % C;  // half 0 is dw, 1 is db; channel ch sits at [ch % PACK][ch / PACK]
        float acc = 0.0f;
        for (int k = 0; k < warps; k++) acc += slices[k * 2 * C + half * C + (ch % PACK) * packs + ch / PACK];
        partial[(long long)blockIdx.x * 2 * C + j] = acc;
    }
}
