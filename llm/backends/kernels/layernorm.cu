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
constexpr int C = CHANNELS, PACKS = C / PACK, LANE_PACKS = (PACKS + 31) / 32;   // a lane's packs of a row
static_assert(C % PACK == 0, "the launcher checks that C is a multiple of 8");

// Lane `lane` owns packs lane, lane + 32, ... of every row: channels (lane + 32k) * PACK ... + PACK - 1.
__device__ __forceinline__ bool owns(int lane, int k) { return (lane + 32 * k) < PACKS; }
__device__ __forceinline__ int channel(int lane, int k) { return (lane + 32 * k) * PACK; }

// One warp per row, 8 rows per 256-thread block; the lanes hold the row in registers while they take its
// mean, then its variance, then write it out. They hold it as stored, in packs, not widened to float: at
// C = 1600 that is 64 registers a thread instead of 85, four blocks an SM instead of two, and twice the rows
// in flight for a kernel that only waits on memory. With inp2 not null the row is first the residual sum
// x = inp1 + inp2, which is also written to residual (llm.c's fused_residual_forward): the residual add and
// the next layernorm in one pass, as the model does between layers.
extern "C" __global__ void layernorm_forward(floatX* residual, floatX* out, float* mean, float* rstd,
                                             const floatX* inp1, const floatX* inp2, const floatX* w,
                                             const floatX* b, int N) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    const long long offset = (long long)row * C;
    Pack x[LANE_PACKS];   // the row as stored
    float sum = 0.0f;
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++) {
        if (!owns(lane, k)) continue;
        x[k] = load_pack(inp1 + offset + channel(lane, k));
        if (inp2) {
            const Pack q = load_pack(inp2 + offset + channel(lane, k));
            #pragma unroll
            for (int i = 0; i < PACK; i++) x[k].v[i] = floatX((float)x[k].v[i] + (float)q.v[i]);
            store_pack(residual + offset + channel(lane, k), x[k]);
        }
        #pragma unroll
        for (int i = 0; i < PACK; i++) sum += (float)x[k].v[i];
    }
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++)
        if (owns(lane, k))
            #pragma unroll
            for (int i = 0; i < PACK; i++) sq += ((float)x[k].v[i] - m) * ((float)x[k].v[i] - m);
    const float s = rsqrtf(warp_sum(sq) / C + 1e-5f);
    #pragma unroll
    for (int k = 0; k < LANE_PACKS; k++) {
        if (!owns(lane, k)) continue;
        const int c = channel(lane, k);
        const Pack pw = load_pack(w + c), pb = load_pack(b + c);
        Pack r;
        #pragma unroll
        for (int i = 0; i < PACK; i++)
            r.v[i] = floatX(((float)x[k].v[i] - m) * s * (float)pw.v[i] + (float)pb.v[i]);
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
// WARPS. A lane loads its share of the row's x, dout and dinp once, into registers, before it works on
// any of them: the kernel is bound by memory, and dinp loaded only when it is written would make a second
// round trip a row. Its channels' dw and db sums (and with SUMS = 3 the column sums of dinp as updated)
// run across every row it visits in its warp's slice of shared memory, not in registers: registers then
// hold little more than the row, so an SM keeps more warps' rows in flight, and C = 1600 takes the third
// sum too (in registers it spilled). At the end the block adds the warps' slices in warp order and writes
// one row of `partial` (gridDim.x, SUMS * C: dw, db, then dinp's sums); add_partial_sums (reduce.cu) then
// adds the rows in a fixed order. No atomics anywhere, so the sums are the same on every run. At the step's
// clock (about 1.6 GHz under the power cap) the kernel waits on its own instructions about as much as on
// memory, so the math is written as fused multiply-adds: 13% fewer instructions, 3% faster at d48.
//
// dinp is the residual stream's gradient, which is also the gradient at the output of the projection
// (attproj, or the layer below's fcproj) that added into the stream just below this layernorm: its
// column sums are that projection's bias gradient, summed here from the registers that write dinp rather
// than by a pass of their own.
constexpr int QUADS = PACK / 4;                        // float4s of one sum a pack has
constexpr int SLICE = SUMS * LANE_PACKS * PACK * 32;   // floats of one warp's sums
extern "C" __device__ int layernorm_backward_slice_bytes = SLICE * sizeof(float);   // read by the launcher

// Where lane `lane` keeps quad q of its pack k of sum s in its warp's slice: lanes 16 bytes apart, so that a
// warp's float4 access is 512 contiguous bytes, without bank conflicts.
__device__ __forceinline__ int sum_at(int s, int k, int q, int lane) {
    return ((s * LANE_PACKS + k) * QUADS + q) * 128 + lane * 4;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, 1)
layernorm_backward(floatX* dinp, float* partial, const floatX* dout, const floatX* inp, const floatX* w,
                   const float* mean, const float* rstd, int N) {
    extern __shared__ float4 slices[];   // WARPS slices of SLICE floats (the launcher sizes it)
    float* sums = reinterpret_cast<float*>(slices);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* mine = sums + warp * SLICE;
    for (int j = lane * 4; j < SLICE; j += 128)   // the lane's own positions (sum_at)
        *reinterpret_cast<float4*>(mine + j) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
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
        const float s = rstd[row], ns = -mean[row] * s;   // n = x s + ns
        float sum_g = 0.0f, sum_gn = 0.0f;
        #pragma unroll
        for (int k = 0; k < LANE_PACKS; k++) {
            if (!owns(lane, k)) continue;
            const Pack pw = load_pack(w + channel(lane, k));
            #pragma unroll
            for (int i = 0; i < PACK; i++) {
                const float g = (float)pw.v[i] * (float)pd[k].v[i];
                sum_g += g;
                sum_gn = fmaf(g, fmaf((float)px[k].v[i], s, ns), sum_gn);
            }
        }
        const float mean_g = warp_sum(sum_g) * (1.0f / C), mean_gn = warp_sum(sum_gn) * (1.0f / C);
        #pragma unroll
        for (int k = 0; k < LANE_PACKS; k++) {
            if (!owns(lane, k)) continue;
            const int c = channel(lane, k);
            const Pack pw = load_pack(w + c);
            float add[3][PACK];   // this row's terms of dw, db and dinp's sums
            #pragma unroll
            for (int i = 0; i < PACK; i++) {
                const float n = fmaf((float)px[k].v[i], s, ns), d = (float)pd[k].v[i];
                const float u = fmaf(-n, mean_gn, fmaf((float)pw.v[i], d, -mean_g));
                pdx[k].v[i] = floatX(fmaf(s, u, (float)pdx[k].v[i]));
                add[0][i] = d * n;
                add[1][i] = d;
                add[2][i] = (float)pdx[k].v[i];
            }
            store_pack(dinp + offset + c, pdx[k]);
            #pragma unroll
            for (int sum = 0; sum < SUMS; sum++)
                #pragma unroll
                for (int q = 0; q < QUADS; q++) {
                    float4* at = reinterpret_cast<float4*>(mine + sum_at(sum, k, q, lane));
                    float4 v = *at;
                    v.x += add[sum][4 * q];
                    v.y += add[sum][4 * q + 1];
                    v.z += add[sum][4 * q + 2];
                    v.w += add[sum][4 * q + 3];
                    *at = v;
                }
        }
    }
    __syncthreads();
    // thread j adds position j of every warp's slice, in warp order, and writes it to its channel
    for (int j = threadIdx.x; j < SLICE; j += blockDim.x) {
        const int sum = j / (LANE_PACKS * QUADS * 128), k = j / (QUADS * 128) % LANE_PACKS,
                  q = j / 128 % QUADS, l = j % 128 / 4;
        if (!owns(l, k)) continue;
        float total = 0.0f;
        for (int from = 0; from < WARPS; from++) total += sums[from * SLICE + j];
        partial[(long long)blockIdx.x * SUMS * C + sum * C + channel(l, k) + 4 * q + j % 4] = total;
    }
}
