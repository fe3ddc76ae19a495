// What both flash attention kernels share (flash_attention.cu on mma.sync, flash_attention_hopper.cu on
// wgmma): tiles of HS-wide rows in shared memory, the fragments the tensor cores read and write, and the
// per-tile math between the products (the causal mask, the online softmax, P and dS).
//
// Fragments, for lane = 4g + q of a warp (g = lane / 4 picks a row, q = lane % 4 a pair of columns). The
// warp owns 16 rows of a tile; mma.sync.m16n8k16 and wgmma (each warp of a warpgroup owning 16 of its 64
// rows) lay them out alike:
//   A (16 x 16 bf16, 4 regs of 2): rows g and g+8, columns 2q, 2q+1 and 2q+8, 2q+9
//   C (16 x 8 fp32, 4 floats):     c[0], c[1] at row g, columns 2q, 2q+1; c[2], c[3] at row g+8
// An accumulator of N columns is float acc[N / 8][4]. Two 8-column C tiles side by side are, rounded to
// bf16, the A fragment of the next product (P V), so probabilities never leave the registers.
#include "common.cuh"

#ifndef HS
#define HS 64      // head size: 16, 32 or 64
#endif

typedef __nv_bfloat16 bf16;
#define INF __int_as_float(0x7f800000)   // +infinity (NVRTC has no math.h)

// ---- tiles in shared memory ------------------------------------------------------------------------------
// A tile is rows of HS bf16: SWIZZLE = 2 * HS bytes, HS / 8 chunks of 16 bytes. ldmatrix reads one chunk
// from each of 8 consecutive rows at once; stored plainly, those chunks would share banks. So the 16-byte
// chunk at byte offset o of a tile is stored at o ^ (((o >> 7) & (SWIZZLE / 16 - 1)) << 4): the pattern
// Hopper's copy engine (TMA) writes and its wgmma reads ("128B", "64B" or "32B" swizzle), used by both
// kernels. A tile starts on a 1024-byte boundary, where the pattern starts.
constexpr int SWIZZLE = 2 * HS;

__device__ __forceinline__ int at(int row, int chunk) {   // element offset of (row, chunk) in a tile
    // (o >> 7 is row * SWIZZLE >> 7)
    return row * HS + ((chunk ^ ((row * SWIZZLE >> 7) & (SWIZZLE / 16 - 1))) << 3);
}

// Four 8x8 bf16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i, and each lane
// receives, in register i, the two elements at (row g, columns 2q, 2q+1) of matrix i; with .trans, the two
// at (rows 2q, 2q+1, column g): the layout a B fragment needs from a row-major (k, n) tile.
__device__ __forceinline__ void ldmatrix(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
}

__device__ __forceinline__ void ldmatrix_trans(unsigned r[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((unsigned)__cvta_generic_to_shared(p)));
}

// The A fragments of rows row0 .. row0+15 of a tile (16 columns per fragment): a warp's own rows of Q
// (forward, dQ), of K and V (dK, dV) or of dO (dQ), kept in registers.
__device__ __forceinline__ void load_rows(unsigned frag[][4], const bf16* tile, int row0) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int kk = 0; kk < HS / 16; kk++)
        ldmatrix(frag[kk], tile + at(row0 + lane % 8 + 8 * (lane / 8 % 2), 2 * kk + lane / 16));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);   // lo in the low half: the lower column
    return *reinterpret_cast<unsigned*>(&v);
}

// The A fragment of columns 16kk .. 16kk+15 of an fp32 accumulator, rounded to bf16.
__device__ __forceinline__ void a_fragment(unsigned a[4], const float p[][4], int kk) {
    a[0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
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

// The backward's store: a warp's 16 x HS tile of dQ, dK or dV (part 0, 1 or 2) of head h, times scale, into
// dqkv (B, T, 3C) as store_rows writes it, and the tile's column sums (of the values as rounded to bf16)
// into row b * ceil(T / 16) + row0 / 16 of bias_sums (B * ceil(T / 16), 3C) fp32. Those rows, added up
// later, are the qkv layer's bias gradient, the column sums of dqkv: made here from the registers, they
// spare a pass that reads dqkv back. The 8 lanes of a quad position q hold the same columns; three
// shuffles add their rows, and lanes 0-3 write. A warp whose rows all lie past T writes nothing.
__device__ __forceinline__ void store_gradient(bf16* dqkv, float* bias_sums, int part, int b, int h, int C,
                                               int row0, int T, const float acc[][4], float scale) {
    if (row0 >= T) return;
    const float scales[2] = {scale, scale};
    store_rows(dqkv + (long long)b * T * 3 * C + part * C + h * HS, 3 * C, row0, T, acc, scales);
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    float* sums = bias_sums + ((long long)b * ((T + 15) / 16) + row0 / 16) * 3 * C + part * C + h * HS;
    #pragma unroll
    for (int dn = 0; dn < HS / 8; dn++) {
        float2 s = make_float2(0.0f, 0.0f);
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            if (row0 + g + 8 * r >= T) continue;
            const float2 v = __bfloat1622float2(
                __floats2bfloat162_rn(acc[dn][2 * r] * scale, acc[dn][2 * r + 1] * scale));
            s.x += v.x;
            s.y += v.y;
        }
        #pragma unroll
        for (int offset = 4; offset < 32; offset *= 2) {
            s.x += __shfl_xor_sync(0xffffffffu, s.x, offset);
            s.y += __shfl_xor_sync(0xffffffffu, s.y, offset);
        }
        if (g == 0) *reinterpret_cast<float2*>(sums + 8 * dn + 2 * q) = s;
    }
}

// ---- the math between the products ---------------------------------------------------------------------
// Forward, one tile of scores s = Q K^T (16 x N, the warp's query rows row0.., keys k0..): mask the keys
// after each query, then the online softmax: per row, the running max m and the running sum l of
// exp(s - m) (this thread's columns only; the quad adds them at the end) move to the new max, and s
// becomes P = exp(s - m) (unnormalised). The output o must move to the new max too: rescale_rows(o,
// rescale), once no product still writes it. Scores are in log2 units: scale_log2 = log2(e) / sqrt(hs).
template <int N>
__device__ __forceinline__ void softmax_step(float s[][4], float m[2], float l[2], float rescale[2], int row0,
                                             int k0, float scale_log2) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    float tile_max[2] = {-INF, -INF};
    const bool diagonal = k0 + N - 1 > row0;   // else no key of the tile comes after a query here
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = row0 + g + 8 * (i / 2), key = k0 + 8 * nt + 2 * q + i % 2;
            s[nt][i] = diagonal && key > row ? -INF : s[nt][i] * scale_log2;   // the causal mask
            tile_max[i / 2] = fmaxf(tile_max[i / 2], s[nt][i]);
        }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        const float new_m = fmaxf(m[r], tile_max[r]);
        rescale[r] = fast_exp2(m[r] - new_m);
        m[r] = new_m;
        l[r] *= rescale[r];
    }
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            s[nt][i] = fast_exp2(s[nt][i] - m[i / 2]);   // masked: exp2(-inf) = 0
            l[i / 2] += s[nt][i];
        }
}

// o's rows g and g+8 times rescale[0] and rescale[1].
__device__ __forceinline__ void rescale_rows(float o[][4], const float rescale[2]) {
    #pragma unroll
    for (int dn = 0; dn < HS / 8; dn++) {
        o[dn][0] *= rescale[0];
        o[dn][1] *= rescale[0];
        o[dn][2] *= rescale[1];
        o[dn][3] *= rescale[1];
    }
}

// Forward, after the last tile: each row's log-sum-exp into lse_row, and 1 / l, by which the caller scales o
// as it stores it. The lse is kept in log2 units, as the scores are (m + log2 l = log2(e) lse): the backward
// then makes each probability with one FMA and one exponential, exp2(s * scale_log2 - lse).
__device__ __forceinline__ void finish_softmax(float* lse_row, int row0, int T, const float m[2], float l[2],
                                               float inv_l[2]) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int row = row0 + g + 8 * r;
        if (q == 0 && row < T) lse_row[row] = m[r] + log2f(l[r]);
        inv_l[r] = 1.0f / l[r];
    }
}

// Backward, dQ's rows g and g+8 of row0..: their lse; rows past T read as +inf (P = 0). Apart from D (next),
// so that a kernel can load it before its tiles of dO and O have landed.
__device__ __forceinline__ void row_lse(float L[2], const float* lse_row, int row0, int T) {
    const int g = threadIdx.x % 32 / 4;
    #pragma unroll
    for (int r = 0; r < 2; r++) L[r] = row0 + g + 8 * r < T ? lse_row[row0 + g + 8 * r] : INF;
}

// Backward, dQ's rows g and g+8 of row0..: D = rowsum(dO * O) from the warp's fragments of dO and O
// (load_rows': registers 0 and 2 hold row g, 1 and 3 row g + 8), the four lanes of a row adding up their
// columns by shuffles. Each row's first lane writes its D to the head's D_row, for the dK, dV kernel that
// runs next. Rows past T have dO and O zero, so D = 0.
__device__ __forceinline__ void row_D(float Drow[2], float* D_row, int row0, int T, const unsigned dof[][4],
                                      const unsigned of[][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4;
    Drow[0] = Drow[1] = 0.0f;
    #pragma unroll
    for (int kk = 0; kk < HS / 16; kk++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const float2 d = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dof[kk][i]));
            const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&of[kk][i]));
            Drow[i % 2] += d.x * o.x + d.y * o.y;
        }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        Drow[r] += __shfl_xor_sync(0xffffffffu, Drow[r], 1);
        Drow[r] += __shfl_xor_sync(0xffffffffu, Drow[r], 2);
        const int row = row0 + g + 8 * r;
        if (row < T && lane % 4 == 0) D_row[row] = Drow[r];
    }
}

// Backward, dQ's tile (rows are queries row0.., columns keys k0..), in two steps, so that the Hopper kernel
// can compute P while the tensor cores still compute dP: from s = Q K^T, P = exp2(s * scale_log2 - L)
// (0 after each query's own key), into p; then, from dp = dO V^T, dS = P * (dP - D), into dp. L is the
// row's lse (row_lse) and Drow its D (row_D).
template <int N>
__device__ __forceinline__ void row_probabilities(float p[][4], int row0, int k0, float scale_log2,
                                                  const float L[2]) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const bool diagonal = k0 + N - 1 > row0;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = row0 + g + 8 * (i / 2), key = k0 + 8 * nt + 2 * q + i % 2;
            p[nt][i] = diagonal && key > row ? 0.0f : fast_exp2(p[nt][i] * scale_log2 - L[i / 2]);
        }
}

template <int N>
__device__ __forceinline__ void row_score_gradients(float dp[][4], const float p[][4], const float Drow[2]) {
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++)
        #pragma unroll
        for (int i = 0; i < 4; i++) dp[nt][i] = p[nt][i] * (dp[nt][i] - Drow[i / 2]);
}

// Backward, dK and dV's tile, transposed (rows are keys key0.., columns queries t0..): the same two steps
// from s^T = K Q^T and dp^T = V dO^T, with each column's lse and D from shared memory, tL and tD (8-byte
// aligned: a thread's two columns are one load).
template <int N>
__device__ __forceinline__ void column_probabilities(float p[][4], int key0, int t0, float scale_log2,
                                                     const float* tL) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const bool diagonal = t0 < key0 + 15;   // else every query of the tile sees every key here
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) {
        const float2 L = *reinterpret_cast<const float2*>(tL + 8 * nt + 2 * q);   // columns 2q, 2q + 1
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const int key = key0 + g + 8 * (j / 2), col = 8 * nt + 2 * q + j % 2;
            const float lse = j % 2 ? L.y : L.x;
            p[nt][j] = diagonal && t0 + col < key ? 0.0f : fast_exp2(p[nt][j] * scale_log2 - lse);
        }
    }
}

template <int N>
__device__ __forceinline__ void column_score_gradients(float dp[][4], const float p[][4], const float* tD) {
    const int q = threadIdx.x % 4;
    #pragma unroll
    for (int nt = 0; nt < N / 8; nt++) {
        const float2 D = *reinterpret_cast<const float2*>(tD + 8 * nt + 2 * q);
        #pragma unroll
        for (int j = 0; j < 4; j++) dp[nt][j] = p[nt][j] * (dp[nt][j] - (j % 2 ? D.y : D.x));
    }
}
