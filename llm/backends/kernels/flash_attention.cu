// Flash attention (FlashAttention-2, Dao 2023) for GPT-2's causal self-attention, bf16 on tensor cores.
//
// The naive attention (attention.cu, reference/attention.py) writes the scores S = q k^T * scale of every
// (query, key) pair to memory, (T, T) per head, softmaxes them in a second pass and multiplies by v in a
// third, and keeps the probabilities for the backward: 18 GiB at GPT-2 124M with B=64, T=1024. Flash
// attention never writes S anywhere. It cuts the queries into tiles of BQ rows and the keys and values into
// tiles of BK rows. One thread block owns one query tile and walks over the key tiles up to the diagonal
// (causal: the tiles above it are all masked out); each (BQ, BK) block of scores lives only in registers.
//
// The softmax still comes out exact, by the online softmax (common.cuh): per query row the block keeps the
// largest score seen so far, m, the sum l of exp(s - m) over the scores seen so far, and the output so far,
// o = sum of exp(s - m) v, unnormalised. A new tile of scores with a larger max m' multiplies l and o by
// exp(m - m') first, which is exactly what they would have been had m' been known from the start. After
// the last tile, out = o / l is softmax(S) v to the last bit of float arithmetic, not an approximation.
//
// What the backward needs is then only the output and, per row, the log-sum-exp lse = m + log(l) (B, NH, T)
// in fp32: from q, k and lse it recomputes any tile of probabilities as P = exp(S - lse), and it keeps no
// (T, T) matrix either. With dO the gradient at the output and D = rowsum(dO * out) (a pre-pass; it equals
// sum_j P_ij dP_ij, the term the softmax's Jacobian subtracts, because out = P v):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = dS K * scale,   dK = dS^T Q * scale.
// Here it runs as two kernels, so that every sum is made by one thread block in a fixed order (the same
// result on every run, no atomics): one block per key tile sums dK and dV over the query tiles that see it,
// and one block per query tile sums dQ over its key tiles.
//
// The products run on the tensor cores through mma.sync.m16n8k16 (a warp multiplies a 16x16 bf16 tile by a
// 16x8 one into a 16x8 fp32 tile). Each warp owns 16 rows of its block's tile. Tiles come from global memory
// into shared memory with cp.async, the next tile in flight while the current one is multiplied, and from
// shared memory into the registers an mma wants with ldmatrix. q, k and v are read straight out of the qkv
// buffer (B, T, 3C) and the output is written to (B, T, C): no permutes.
//
// The launcher (llm/backends/attention.py: FlashAttention) sets the head size and the tiles as defines, one
// module per head size; the values below are defaults only.
#include "common.cuh"

#ifndef HS
#define HS 64      // head size: 16, 32 or 64
#endif
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

typedef __nv_bfloat16 bf16;
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
#define INF __int_as_float(0x7f800000)   // +infinity (NVRTC has no math.h)

// ---- tensor-core and copy primitives ---------------------------------------------------------------------
// Fragments of mma.m16n8k16 for lane = 4g + q (g = lane / 4 picks a row, q = lane % 4 a pair of columns):
//   A (16 x 16 bf16, 4 regs of 2): rows g and g+8, columns 2q, 2q+1 and 2q+8, 2q+9
//   B (16 x 8 bf16, 2 regs of 2):  rows (k) 2q, 2q+1 and 2q+8, 2q+9 of column (n) g
//   C (16 x 8 fp32, 4 floats):     c[0], c[1] at row g, columns 2q, 2q+1; c[2], c[3] at row g+8
// A C tile of scores is, two n-tiles side by side, the A fragment of the next product (P V), so
// probabilities never leave the registers.
__device__ __forceinline__ void mma(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i, and each lane
// receives, in register i, the two elements at (row g, columns 2q, 2q+1) of matrix i; with .trans, the two
// at (rows 2q, 2q+1, column g): the layout a B fragment needs from a row-major (k, n) tile.
__device__ __forceinline__ void ldmatrix(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}

__device__ __forceinline__ void ldmatrix_trans(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
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

// 2^x by the special-function unit in one instruction (exp2f without fast math adds range handling);
// ex2.approx(-inf) = 0, which is what the causal mask relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // lo in the low half: the lower column
    return *reinterpret_cast<unsigned*>(&v);
}

// ---- tiles in shared memory ------------------------------------------------------------------------------
// A tile is R rows of HS bf16, HS / 8 chunks of 16 bytes a row. ldmatrix reads one chunk from each of 8
// consecutive rows at once; stored plainly, those 8 chunks would share banks. Chunk c of row r is stored
// at chunk c ^ (r % chunks) instead (a swizzle), which puts them in 8 different banks for HS = 64.
__device__ __forceinline__ int at(int row, int chunk) {
    return row * HS + ((chunk ^ (row % (HS / 8))) << 3);
}

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

// The A fragments of rows row0 .. row0+15 of a tile (16 columns per fragment): the warp's own rows of Q
// (forward, dQ), or of K and V (dK, dV), kept in registers for the whole kernel.
__device__ __forceinline__ void load_rows(unsigned frag[][4], const bf16* tile, int row0) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int kk = 0; kk < HS / 16; kk++)
        ldmatrix(frag[kk], tile + at(row0 + lane % 8 + 8 * (lane / 8 % 2), 2 * kk + lane / 16));
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
        const unsigned a[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                               pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                               pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        #pragma unroll
        for (int dn = 0; dn < HS / 8; dn += 2) {
            unsigned b[4];
            ldmatrix_trans(b, tile + at(16 * kk + lane % 8 + 8 * (lane / 8 % 2), dn + lane / 16));
            mma(acc[dn], a, b[0], b[1]);
            mma(acc[dn + 1], a, b[2], b[3]);
        }
    }
}

// Write the warp's 16 x HS fp32 tile `acc`, row r (g, then g+8) times scale[r], as bf16 into rows
// row0 .. row0+15 of a (T, stride) matrix at dst; rows at or past T are not written.
__device__ __forceinline__ void store_rows(bf16* dst, long long stride, int row0, int T, const float acc[][4],
                                           const float scale[2]) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        if (row >= T) continue;
#pragma unroll
        for (int dn = 0; dn < HS / 8; dn++)
            *reinterpret_cast<__nv_bfloat162*>(dst + row * stride + 8 * dn + 2 * q) =
                __floats2bfloat162_rn(acc[dn][2 * r] * scale[r], acc[dn][2 * r + 1] * scale[r]);
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
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
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
            float tile_max[2] = {-INF, -INF};
            const bool diagonal = k0 + BK - 1 > row0;   // else no key of the tile comes after a query here
            #pragma unroll
            for (int nt = 0; nt < BK / 8; nt++)
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int row = row0 + g + 8 * (i / 2), key = k0 + 8 * nt + 2 * q + i % 2;
                    s[nt][i] = diagonal && key > row ? -INF : s[nt][i] * scale_log2;   // the causal mask
                    tile_max[i / 2] = fmaxf(tile_max[i / 2], s[nt][i]);
                }
            #pragma unroll
            for (int r = 0; r < 2; r++) {   // the online softmax: rescale what came before to the new max
                tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
                tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
                const float new_m = fmaxf(m[r], tile_max[r]), rescale = fast_exp2(m[r] - new_m);
                m[r] = new_m;
                l[r] *= rescale;
                #pragma unroll
                for (int dn = 0; dn < HS / 8; dn++) {
                    o[dn][2 * r] *= rescale;
                    o[dn][2 * r + 1] *= rescale;
                }
            }
            #pragma unroll
            for (int nt = 0; nt < BK / 8; nt++)
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    s[nt][i] = fast_exp2(s[nt][i] - m[i / 2]);   // masked: exp2(-inf) = 0
                    l[i / 2] += s[nt][i];
                }
            mul_tiles_by_tile<BK>(o, s, sV[cur]);
        }
        cp_async_wait_all();
        __syncthreads();   // the next tile has landed, and no warp still reads the one it will replace
    }

    #pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int row = row0 + g + 8 * r;
        if (q == 0 && row < T) lse[(long long)blockIdx.y * T + row] = (m[r] + log2f(l[r])) * LN2;
    }
    const float inv_l[2] = {1.0f / l[0], 1.0f / l[1]};
    store_rows(out + (long long)b * T * C + h * HS, C, row0, T, o, inv_l);
}

// ---- backward ------------------------------------------------------------------------------------------
// D = rowsum(dO * out) per (b, head, t), fp32 (B, NH, T). A head's row is HS / 8 packs of 8 bf16, one
// thread per pack, so that a warp reads 512 contiguous bytes of each input; the HS / 8 threads of a row add
// their parts by shuffles, and the first writes the row's D.
extern "C" __global__ void flash_backward_dot(float* D, const bf16* dout, const bf16* out, int B, int T, int NH) {
    constexpr int PACKS = HS / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // pack i of (B, T, NH, HS)
    const long long row = i / PACKS, rows = (long long)B * T * NH;         // row = (b, t, h)
    float acc = 0.0f;
    if (row < rows) {
        const uint4 pd = reinterpret_cast<const uint4*>(dout)[i], po = reinterpret_cast<const uint4*>(out)[i];
        const bf16* xd = reinterpret_cast<const bf16*>(&pd);
        const bf16* xo = reinterpret_cast<const bf16*>(&po);
        #pragma unroll
        for (int k = 0; k < 8; k++) acc += (float)xd[k] * (float)xo[k];
    }
    #pragma unroll
    for (int offset = PACKS / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (row < rows && i % PACKS == 0) {
        const long long bt = row / NH, b = bt / T;
        D[(b * NH + row % NH) * T + bt % T] = acc;
    }
}

// dK and dV of one key tile. Grid (T / BK key tiles, B * NH), 128 threads; warp w owns keys k0 + 16w ...
// It keeps its rows of K and V in registers and walks the query tiles from the diagonal down, computing the
// transposed tiles S^T = K Q^T and dP^T = V dO^T so that each warp's rows stay its keys:
//   P^T = exp(S^T - lse) (0 above the diagonal),  dS^T = P^T * (dP^T - D),  dV += P^T dO,  dK += dS^T Q.
// Shared memory: Q and dO tiles, two of each in flight, and their rows' lse and D.
extern "C" __global__ void __launch_bounds__(THREADS)
flash_backward_dkv(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int T, int NH,
                   float scale) {
    __shared__ alignas(128) bf16 sQ[2 * BQ * HS], sdO[2 * BQ * HS];
    __shared__ float sL[2 * BQ], sD[2 * BQ];
    const int C = NH * HS;
    const int k0 = blockIdx.x * BK, b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
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
            const bool diagonal = t0 < key0 + 15;      // else every query of the tile sees every key here
            #pragma unroll
            for (int nt = 0; nt < BQ / 8; nt++)
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int key = key0 + g + 8 * (j / 2), col = 8 * nt + 2 * q + j % 2;
                    p[nt][j] = diagonal && t0 + col < key ? 0.0f : fast_exp2((p[nt][j] * scale - tL[col]) * LOG2E);
                    dp[nt][j] = p[nt][j] * (dp[nt][j] - tD[col]);   // dS^T
                }
            mul_tiles_by_tile<BQ>(dv, p, tdO);
            mul_tiles_by_tile<BQ>(dk, dp, tQ);
        }
        cp_async_wait_all();
        __syncthreads();
    }

    const float scales[2] = {scale, scale}, ones[2] = {1.0f, 1.0f};
    bf16* rows = dqkv + (long long)b * T * 3 * C + h * HS;
    store_rows(rows + C, 3 * C, key0, T, dk, scales);
    store_rows(rows + 2 * C, 3 * C, key0, T, dv, ones);
}

// dQ of one query tile. Grid (T / BQ query tiles, B * NH), 128 threads; warp w owns queries q0 + 16w ...
// Its rows of Q and dO stay in registers; it walks the key tiles up to the diagonal:
//   P = exp(S - lse) (0 above the diagonal),  dS = P * (dP - D),  dQ += dS K.
extern "C" __global__ void __launch_bounds__(THREADS)
flash_backward_dq(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* D, int T, int NH,
                  float scale) {
    const float scale_log2 = scale * LOG2E;
    __shared__ alignas(128) bf16 sK[2][BK * HS], sV[2][BK * HS];
    const int C = NH * HS;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ, b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int row0 = q0 + 16 * warp;
    const bf16* base = qkv + (long long)b * T * 3 * C + h * HS;
    const int tiles = min(q0 + BQ - 1, T - 1) / BK + 1;

    // Q and dO through the second stage's buffers into registers, the first key tile into the first stage
    load_tile<BQ>(sK[1], base, q0, T, 3 * C);
    load_tile<BQ>(sV[1], dout + (long long)b * T * C + h * HS, q0, T, C);
    load_tile<BK>(sK[0], base + C, 0, T, 3 * C);
    load_tile<BK>(sV[0], base + 2 * C, 0, T, 3 * C);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    unsigned qf[HS / 16][4], dof[HS / 16][4];
    load_rows(qf, sK[1], 16 * warp);
    load_rows(dof, sV[1], 16 * warp);
    float L[2], Drow[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + g + 8 * r;
        L[r] = row < T ? lse[(long long)blockIdx.y * T + row] * LOG2E : INF;
        Drow[r] = row < T ? D[(long long)blockIdx.y * T + row] : 0.0f;
    }
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
            const bool diagonal = k0 + BK - 1 > row0;
            #pragma unroll
            for (int nt = 0; nt < BK / 8; nt++)
                #pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int row = row0 + g + 8 * (i / 2), key = k0 + 8 * nt + 2 * q + i % 2;
                    p[nt][i] = diagonal && key > row ? 0.0f : fast_exp2(p[nt][i] * scale_log2 - L[i / 2]);
                    dp[nt][i] = p[nt][i] * (dp[nt][i] - Drow[i / 2]);   // dS
                }
            mul_tiles_by_tile<BK>(dq, dp, sK[cur]);
        }
        cp_async_wait_all();
        __syncthreads();
    }

    const float scales[2] = {scale, scale};
    store_rows(dqkv + (long long)b * T * 3 * C + h * HS, 3 * C, row0, T, dq, scales);
}
