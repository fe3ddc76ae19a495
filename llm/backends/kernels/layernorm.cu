// LayerNorm over the C channels of each of the B*T rows: out = (x - mean) * rstd * w + b, with
// rstd = 1 / sqrt(var + 1e-5) and the biased variance (divided by C), as llm.c; and its backward.
//
// The launcher (cupy_backend.py) compiles this file once per C, passed as CHANNELS, so that a lane can keep
// its share of a row in registers: the row is read from memory once, not once per pass over it.
#include "common.cuh"

#ifndef CHANNELS
#define CHANNELS 768
#endif
#ifndef WARPS
#define WARPS 8        // warps per block of layernorm_backward
#endif
#ifndef SUMS
#define SUMS 2         // column sums layernorm_backward makes: dw, db, and with 3 also dinp's
#endif
#ifndef BLOCKS
#define BLOCKS 2       // blocks of layernorm_backward per SM, as the launcher's grid has them
#endif
constexpr int C = CHANNELS, PACKS = C / PACK, LANE_PACKS = (PACKS + 31) / 32;   // a lane's packs of a row
static_assert(C % PACK == 0, "the launcher checks that C is a multiple of 8");

// Lane `lane` owns packs lane, lane + 32, ... of every row: channels (lane + 32k) * PACK ... + PACK - 1.
__device__ __forceinline__ bool owns(int lane, int k) { return (lane + 32 * k) < PACKS; }
__device__ __forceinline__ int channel(int lane, int k) { return (lane + 32 * k) * PACK; }

// One warp per row, 8 rows per 256-thread block; the lanes hold the row in registers while they take its
// mean, then its variance, then write it out. With inp2 not null the row is first the residual sum
// x = inp1 + inp2, which is also written to residual (llm.c's fused_residual_forward): the residual add and
// the next layernorm in one pass, as the model does between layers.
extern "C" __global__ void layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd,
                                             const floatX* inp1, const floatX* inp2, const floatX* w,
                                             const floatX* b, int N) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const long long offset = (long long)row * C;
    float x[LANE_PACKS][PACK];
    float sum = 0.0f;
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++) {
        if (!owns(lane, k)) continue;
        const Pack p = load_pack(inp1 + offset + channel(lane, k));
        Pack q;
        if (inp2) q = load_pack(inp2 + offset + channel(lane, k));
        #pragma unroll
        for (int i = 0; i < PACK; i++) {
            x[k][i] = inp2 ? (float)floatX((float)p.v[i] + (float)q.v[i]) : (float)p.v[i];   // as stored
            if (inp2) q.v[i] = floatX(x[k][i]);
            sum += x[k][i];
        }
        if (inp2) store_pack(residual + offset + channel(lane, k), q);
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++)
        if (owns(lane, k))
            #pragma unroll
            for (int i = 0; i < PACK; i++) sq += (x[k][i] - m) * (x[k][i] - m);
    const float s = rsqrtf(warp_sum(sq) / C + 1e-5f);
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++) {
        if (!owns(lane, k)) continue;
        const int c = channel(lane, k);
        const Pack pw = load_pack(w + c), pb = load_pack(b + c);
        Pack r;
        #pragma unroll
        for (int i = 0; i < PACK; i++) r.v[i] = floatX((x[k][i] - m) * s * (float)pw.v[i] + (float)pb.v[i]);
        store_pack(out + offset + c, r);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// With n = (x - mean) * rstd and g = w * dout:
//   dinp += rstd * (g - mean(g) - n * mean(g * n)),  dw += sum over rows of dout * n,  db += sum of dout.
// One warp per row at a time: warp `warp` of block k takes rows k * WARPS + warp, stepping by gridDim.x *
// WARPS. A lane loads its share of the row's x, dout and dinp once, into registers, and keeps its channels'
// dw and db sums in registers across every row it visits. It loads all three before it works on any: the
// kernel is bound by memory, and dinp loaded only when it is written would make a second round trip a row.
// At the end the warps add their sums into shared memory one after the other, in warp order, and the
// block writes one row of `partial` (gridDim.x, SUMS * C: dw, db, then with SUMS = 3 the column sums of
// dinp as updated); add_partial_sums (reduce.cu) then adds the rows in order. No atomics anywhere, so the
// sums are the same on every run.
//
// dinp is the residual stream's gradient, which is also the gradient at the output of the projection
// (attproj, or the layer below's fcproj) that added into the stream just below this layernorm: its
// column sums are that projection's bias gradient, summed here from the registers that write dinp rather
// than by a pass of their own.
extern "C" __global__ void __launch_bounds__(32 * WARPS, BLOCKS)
layernorm_backward(floatX* dinp, float* partial, const floatX* dout, const floatX* inp, const floatX* w,
                   const float* mean, const float* rstd, int N) {
    __shared__ float block_sums[SUMS * C];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float dw[LANE_PACKS][PACK] = {}, db[LANE_PACKS][PACK] = {}, dr[LANE_PACKS][PACK] = {};
    for (int row = blockIdx.x * WARPS + warp; row < N; row += gridDim.x * WARPS) {
        const long long offset = (long long)row * C;
        Pack px[LANE_PACKS], pd[LANE_PACKS], pdx[LANE_PACKS];
        #pragma unroll
        for (int k = 0; k < LANE_PACKS; k++)
            if (owns(lane, k)) {
                px[k] = load_pack(inp + offset + channel(lane, k));
                pd[k] = load_pack(dout + offset + channel(lane, k));
                pdx[k] = load_pack(dinp + offset + channel(lane, k));
            }
        const float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_gn = 0.0f;
        #pragma unroll
        for (int k = 0; k < LANE_PACKS; k++) {
            if (!owns(lane, k)) continue;
            const Pack pw = load_pack(w + channel(lane, k));
            #pragma unroll
            for (int i = 0; i < PACK; i++) {
                const float g = (float)pw.v[i] * (float)pd[k].v[i];
                sum_g += g;
                sum_gn += g * ((float)px[k].v[i] - m) * s;
            }
        }
        const float mean_g = warp_sum(sum_g) / C, mean_gn = warp_sum(sum_gn) / C;
        #pragma unroll
        for (int k = 0; k < LANE_PACKS; k++) {
            if (!owns(lane, k)) continue;
            const int c = channel(lane, k);
            const Pack pw = load_pack(w + c);
            #pragma unroll
            for (int i = 0; i < PACK; i++) {
                const float n = ((float)px[k].v[i] - m) * s, d = (float)pd[k].v[i];
                pdx[k].v[i] = floatX((float)pdx[k].v[i] + s * ((float)pw.v[i] * d - mean_g - n * mean_gn));
                dw[k][i] += d * n;
                db[k][i] += d;
                if (SUMS == 3) dr[k][i] += (float)pdx[k].v[i];
            }
            store_pack(dinp + offset + c, pdx[k]);
        }
    }
    for (int j = threadIdx.x; j < SUMS * C; j += blockDim.x) block_sums[j] = 0.0f;
    __syncthreads();
    for (int turn = 0; turn < WARPS; turn++) {   // warp by warp: a fixed order of additions
        if (warp == turn)
            #pragma unroll
            for (int k = 0; k < LANE_PACKS; k++)
                if (owns(lane, k))
                    #pragma unroll
                    for (int i = 0; i < PACK; i++) {
                        block_sums[channel(lane, k) + i] += dw[k][i];
                        block_sums[C + channel(lane, k) + i] += db[k][i];
                        if (SUMS == 3) block_sums[2 * C + channel(lane, k) + i] += dr[k][i];
                    }
        __syncthreads();
    }
    for (int j = threadIdx.x; j < SUMS * C; j += blockDim.x)
        partial[(long long)blockIdx.x * SUMS * C + j] = block_sums[j];
}
