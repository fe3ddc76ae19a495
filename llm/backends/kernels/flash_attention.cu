// Flash attention (FlashAttention-2, Dao 2023) for GPT-2's causal self-attention, bf16 on tensor cores.
//
// The naive attention (attention.cu, reference/attention.py) writes the scores S = q k^T * scale of every
// (query, key) pair to memory, (T, T) per head, softmaxes them in a second pass and multiplies by v in a
// third, and keeps the probabilities for the backward: 18 GiB at GPT-2 124M with B=64, T=1024. Flash
// attention never writes S anywhere. It cuts the queries into tiles of BQ rows and the keys and values into
// tiles of BK rows. One thread block owns one query tile and walks over the key tiles up to the diagonal
// (causal: the tiles above it are all masked out); each (BQ, BK) block of scores lives only in registers.
//
// The softmax still comes out exact, by the online softmax (common.cuh, flash_tiles.cuh): per query row the
// block keeps the largest score seen so far, m, the sum l of exp(s - m) over the scores seen so far, and the
// output so far, o = sum of exp(s - m) v, unnormalised. A new tile of scores with a larger max m' multiplies
// l and o by exp(m - m') first, which is exactly what they would have been had m' been known from the start.
// After the last tile, out = o / l is softmax(S) v to the last bit of float arithmetic, not an approximation.
//
// What the backward needs is then only the output and, per row, the log-sum-exp lse = m + log(l) (B, NH, T)
// in fp32 (kept in log2 units, as the scores: flash_tiles.cuh's finish_softmax): from q, k and lse it
// recomputes any tile of probabilities as P = exp(S - lse), and it keeps no (T, T) matrix either. With dO
// the gradient at the output and D = rowsum(dO * out) (it equals sum_j P_ij dP_ij, the term the softmax's
// Jacobian subtracts, because out = P v):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = dS K * scale,   dK = dS^T Q * scale.
// Here it runs as two kernels, so that every sum is made by one thread block in a fixed order (the same
// result on every run, no atomics): one block per query tile sums dQ over its key tiles, and one block per
// key tile then sums dK and dV over the query tiles that see it. The dQ kernel runs first because it holds
// each query row's dO in registers anyway: it loads the row's out as well, takes D there and writes it for
// the dK, dV kernel, which reads D per query tile. As each warp writes its 16 rows of dQ, dK or dV,
// it also writes their column sums (store_gradient, flash_tiles.cuh): the qkv layer's bias gradient is the
// column sum of dqkv, and adding up those partial rows is cheaper than reading dqkv back.
//
// The products run on the tensor cores through mma.sync.m16n8k16 (a warp multiplies a 16x16 bf16 tile by a
// 16x8 one into a 16x8 fp32 tile). Each warp owns 16 rows of its block's tile. Tiles come from global memory
// into shared memory with cp.async, the next tile in flight while the current one is multiplied, and from
// shared memory into the registers an mma wants with ldmatrix. q, k and v are read straight out of the qkv
// buffer (B, T, 3C) and the output is written to (B, T, C): no permutes.
//
// flash_attention_hopper.cu does the same with Hopper's instructions; this one runs on any GPU from Ampere
// on. What the two share (tiles, fragments, the softmax step) is in flash_tiles.cuh. The launcher
// (llm/backends/attention.py: FlashAttention) sets the head size and the tiles as defines, one module per
// head size; the values below are defaults only.
#include "flash_tiles.cuh"
#ifndef BQ
#define BQ 64      // query rows per tile
#endif
#ifndef BK
#define BK 64      // key rows per tile
#endif
#ifndef WARPS
#define WARPS 4    // warps per block, each owning 16 rows of the block's tile
#endif
constexpr int THREADS = 32 * WARPS;
static_assert(BQ == 16 * WARPS && BK == 16 * WARPS, "each warp owns 16 rows of a query or key tile");


// ---- tensor-core and copy primitives ---------------------------------------------------------------------
// mma.m16n8k16 (fragments as flash_tiles.cuh says; its B, 16 x 8 bf16 in 2 regs of 2, holds rows (k) 2q, 2q+1
// and 2q+8, 2q+9 of column (n) g).
__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes from global to shared memory without passing through registers; zeros where !valid.
__device__ __forceinline__ void cp_async16(bf16* dst, const bf16* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 16 : 0));
}
// One float the same way (the .ca form takes 4 bytes), for rows of lse and D.
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ---- tiles in shared memory (swizzled as flash_tiles.cuh says) -------------------------------------------
// Rows t0 .. t0+R-1 of a (T, stride) bf16 matrix in global memory, HS columns from `src`, into a tile;
// rows at or past T become zeros. Each thread copies every THREADS-th chunk.
template <int R>
__device__ __forceinline__ void load_tile(bf16* tile, const bf16* src, int t0, int T, long long stride) {
    constexpr int CHUNKS = HS / 8;
    for (int i = threadIdx.x; i < R * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS, t = t0 + r;
        cp_async16(tile + at(r, c), src + (t < T ? t : 0) * stride + 8 * c, t < T);
    }
}

// acc (16 x N) += A (16 x HS, fragments `a`) times tile^T, tile (N rows, HS columns): S = Q K^T, dP = dO V^T.
// ldmatrix gives B fragments for two n-tiles of 8 rows at once.
template <int N>
__device__ __forceinline__ void mul_rows_by_tile_t(float acc[][4], const unsigned a[][4], const bf16* tile) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int kk = 0; kk < HS / 16; kk++)
        #pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            unsigned b[4];
            ldmatrix(b, tile + at(8 * nt + lane % 8 + 8 * (lane / 16), 2 * kk + lane / 8 % 2));
            mma(acc[nt], a[kk], b[0], b[1]);
            mma(acc[nt + 1], a[kk], b[2], b[3]);
        }
}

// acc (16 x HS) += P (16 x K, fp32 C tiles `p`, rounded to bf16) times tile (K rows, HS columns):
// O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <int K>
__device__ __forceinline__ void mul_tiles_by_tile(float acc[][4], const float p[][4], const bf16* tile) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int kk = 0; kk < K / 16; kk++) {
        unsigned a[4];
        a_fragment(a, p, kk);
        #pragma unroll
        for (int dn = 0; dn < HS / 8; dn += 2) {
            unsigned b[4];
            ldmatrix_trans(b, tile + at(16 * kk + lane % 8 + 8 * (lane / 8 % 2), dn + lane / 16));
            mma(acc[dn], a, b[0], b[1]);
            mma(acc[dn + 1], a, b[2], b[3]);
        }
    }
}

// ---- forward -------------------------------------------------------------------------------------------
// Grid (T / BQ query tiles, B * NH), 128 threads; the last query tiles, which see the most keys, start first.
// Warp w owns query rows q0 + 16w .. q0 + 16w + 15; a thread holds, per row g and g+8 of that, its m, its
// part of l (summed over its columns; the quad adds them at the end), and 2 columns of each 8 of o.
// scale = 1 / sqrt(hs); the exponentials are exp2 of scores in log2 units, scaled by scale_log2.
extern "C" __global__ void __launch_bounds__(THREADS)
flash_forward(bf16* out, float* lse, const bf16* qkv, int T, int NH, float scale) {
    const float scale_log2 = scale * LOG2E;
    __shared__ alignas(128) bf16 sQ[BQ * HS], sK[2][BK * HS], sV[2][BK * HS];
    const int C = NH * HS;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ, b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x / 32;
    const int row0 = q0 + 16 * warp;
    const bf16* base = qkv + (long long)b * T * 3 * C + h * HS;   // q; k is C further on, v 2C
    const int tiles = min(q0 + BQ - 1, T - 1) / BK + 1;           // key tiles up to the diagonal

    load_tile<BQ>(sQ, base, q0, T, 3 * C);
    load_tile<BK>(sK[0], base + C, 0, T, 3 * C);
    load_tile<BK>(sV[0], base + 2 * C, 0, T, 3 * C);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned qf[HS / 16][4];
    load_rows(qf, sQ, 16 * warp);

    float o[HS / 8][4] = {}, m[2] = {-INF, -INF}, l[2] = {0.0f, 0.0f};
    for (int j = 0; j < tiles; j++) {
        const int cur = j % 2, k0 = j * BK;
        if (j + 1 < tiles) {   // the next key tile flies in while this one is multiplied
            load_tile<BK>(sK[cur ^ 1], base + C, k0 + BK, T, 3 * C);
            load_tile<BK>(sV[cur ^ 1], base + 2 * C, k0 + BK, T, 3 * C);
        }
        cp_async_commit();
        if (k0 <= row0 + 15) {   // else every key of the tile comes after every query of this warp
            float s[BK / 8][4] = {};
            mul_rows_by_tile_t<BK>(s, qf, sK[cur]);
            float rescale[2];
            softmax_step<BK>(s, m, l, rescale, row0, k0, scale_log2);
            rescale_rows(o, rescale);
            mul_tiles_by_tile<BK>(o, s, sV[cur]);
        }
        cp_async_wait_all();
        __syncthreads();   // the next tile has landed, and no warp still reads the one it will replace
    }

    float inv_l[2];
    finish_softmax(lse + (long long)blockIdx.y * T, row0, T, m, l, inv_l);
    store_rows(out + (long long)b * T * C + h * HS, C, row0, T, o, inv_l);
}

// ---- backward ------------------------------------------------------------------------------------------
// dK and dV of one key tile. Grid (T / BK key tiles, B * NH), 128 threads; warp w owns keys k0 + 16w ...
// It keeps its rows of K and V in registers and walks the query tiles from the diagonal down, computing the
// transposed tiles S^T = K Q^T and dP^T = V dO^T so that each warp's rows stay its keys:
//   P^T = exp(S^T - lse) (0 above the diagonal),  dS^T = P^T * (dP^T - D),  dV += P^T dO,  dK += dS^T Q.
// Shared memory: Q and dO tiles, two of each in flight, and their rows' lse and D.
extern "C" __global__ void __launch_bounds__(THREADS)
flash_backward_dkv(bf16* dqkv, float* bias_sums, const bf16* dout, const bf16* qkv, const float* lse,
                   const float* D, int T, int NH, float scale) {
    const float scale_log2 = scale * LOG2E;
    __shared__ alignas(128) bf16 sQ[2 * BQ * HS], sdO[2 * BQ * HS];
    __shared__ alignas(16) float sL[2 * BQ], sD[2 * BQ];
    const int C = NH * HS;
    const int k0 = blockIdx.x * BK, b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x / 32;
    const int key0 = k0 + 16 * warp;
    const bf16* qbase = qkv + (long long)b * T * 3 * C + h * HS;
    const bf16* obase = dout + (long long)b * T * C + h * HS;
    const float* lse_row = lse + (long long)blockIdx.y * T;
    const float* D_row = D + (long long)blockIdx.y * T;
    const int first = k0 / BQ, tiles = (T + BQ - 1) / BQ;   // the query tiles that see these keys

    // K and V through the second stage's buffers into registers, the first query tile into the first stage
    load_tile<BK>(sQ + BQ * HS, qbase + C, k0, T, 3 * C);
    load_tile<BK>(sdO + BQ * HS, qbase + 2 * C, k0, T, 3 * C);
    auto load_queries = [&](int stage, int t0) {
        load_tile<BQ>(sQ + stage * BQ * HS, qbase, t0, T, 3 * C);
        load_tile<BQ>(sdO + stage * BQ * HS, obase, t0, T, C);
        // rows past T read as lse = 0 and D = 0: their dO and Q are 0 too, so they add nothing to dV or dK
        for (int i = threadIdx.x; i < BQ; i += THREADS) {
            const bool valid = t0 + i < T;
            cp_async4(sL + stage * BQ + i, lse_row + (valid ? t0 + i : 0), valid);
            cp_async4(sD + stage * BQ + i, D_row + (valid ? t0 + i : 0), valid);
        }
    };
    load_queries(0, first * BQ);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned kf[HS / 16][4], vf[HS / 16][4];
    load_rows(kf, sQ + BQ * HS, 16 * warp);
    load_rows(vf, sdO + BQ * HS, 16 * warp);
    __syncthreads();

    float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
    for (int i = first; i < tiles; i++) {
        const int cur = (i - first) % 2, t0 = i * BQ;
        if (i + 1 < tiles) load_queries(cur ^ 1, t0 + BQ);
        cp_async_commit();
        const bf16 *tQ = sQ + cur * BQ * HS, *tdO = sdO + cur * BQ * HS;
        const float *tL = sL + cur * BQ, *tD = sD + cur * BQ;
        if (t0 + BQ - 1 >= key0) {   // else every query of the tile comes before every key of this warp
            float p[BQ / 8][4] = {}, dp[BQ / 8][4] = {};
            mul_rows_by_tile_t<BQ>(p, kf, tQ);    // S^T
            mul_rows_by_tile_t<BQ>(dp, vf, tdO);  // dP^T
            column_probabilities<BQ>(p, key0, t0, scale_log2, tL);
            column_score_gradients<BQ>(dp, p, tD);
            mul_tiles_by_tile<BQ>(dv, p, tdO);
            mul_tiles_by_tile<BQ>(dk, dp, tQ);
        }
        cp_async_wait_all();
        __syncthreads();
    }

    store_gradient(dqkv, bias_sums, 1, b, h, C, key0, T, dk, scale);
    store_gradient(dqkv, bias_sums, 2, b, h, C, key0, T, dv, 1.0f);
}

// dQ of one query tile, and D. Grid (T / BQ query tiles, B * NH), 128 threads; warp w owns queries
// q0 + 16w ... Its rows of Q and dO stay in registers; its rows of out pass through them for D, which it
// writes; it walks the key tiles up to the diagonal:
//   P = exp(S - lse) (0 above the diagonal),  dS = P * (dP - D),  dQ += dS K.
extern "C" __global__ void __launch_bounds__(THREADS)
flash_backward_dq(bf16* dqkv, float* bias_sums, const bf16* dout, const bf16* out, const bf16* qkv,
                  const float* lse, float* D, int T, int NH, float scale) {
    const float scale_log2 = scale * LOG2E;
    __shared__ alignas(128) bf16 sK[2][BK * HS], sV[2][BK * HS], sO[BQ * HS];
    const int C = NH * HS;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ, b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x / 32;
    const int row0 = q0 + 16 * warp;
    const bf16* base = qkv + (long long)b * T * 3 * C + h * HS;
    const int tiles = min(q0 + BQ - 1, T - 1) / BK + 1;

    // Q and dO through the second stage's buffers into registers, the first key tile into the first stage
    load_tile<BQ>(sK[1], base, q0, T, 3 * C);
    load_tile<BQ>(sV[1], dout + (long long)b * T * C + h * HS, q0, T, C);
    load_tile<BQ>(sO, out + (long long)b * T * C + h * HS, q0, T, C);
    load_tile<BK>(sK[0], base + C, 0, T, 3 * C);
    load_tile<BK>(sV[0], base + 2 * C, 0, T, 3 * C);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned qf[HS / 16][4], dof[HS / 16][4], of[HS / 16][4];
    load_rows(qf, sK[1], 16 * warp);
    load_rows(dof, sV[1], 16 * warp);
    load_rows(of, sO, 16 * warp);
    float L[2], Drow[2];
    row_lse(L, lse + (long long)blockIdx.y * T, row0, T);
    row_D(Drow, D + (long long)blockIdx.y * T, row0, T, dof, of);
    __syncthreads();

    float dq[HS / 8][4] = {};
    for (int j = 0; j < tiles; j++) {
        const int cur = j % 2, k0 = j * BK;
        if (j + 1 < tiles) {
            load_tile<BK>(sK[cur ^ 1], base + C, k0 + BK, T, 3 * C);
            load_tile<BK>(sV[cur ^ 1], base + 2 * C, k0 + BK, T, 3 * C);
        }
        cp_async_commit();
        if (k0 <= row0 + 15) {
            float p[BK / 8][4] = {}, dp[BK / 8][4] = {};
            mul_rows_by_tile_t<BK>(p, qf, sK[cur]);    // S
            mul_rows_by_tile_t<BK>(dp, dof, sV[cur]);  // dP
            row_probabilities<BK>(p, row0, k0, scale_log2, L);
            row_score_gradients<BK>(dp, p, Drow);
            mul_tiles_by_tile<BK>(dq, dp, sK[cur]);
        }
        cp_async_wait_all();
        __syncthreads();
    }

    store_gradient(dqkv, bias_sums, 0, b, h, C, row0, T, dq, scale);
}
