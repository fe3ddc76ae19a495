// Flash attention on Hopper (H100, H200): flash_attention.cu's algorithm, on the instructions sm_90a adds.
// Read flash_attention.cu first: the tiles, the online softmax, lse, D and the two-pass backward are the same
// here, and so is the math between the products (flash_tiles.cuh). What Hopper changes is how the tiles move
// and how they are multiplied:
//
// - wgmma. A warpgroup (4 warps, 128 threads) multiplies its 64 rows (A, in registers or in shared
//   memory) by a tile B that the tensor cores read straight from shared memory, N columns at once, in one
//   asynchronous instruction. mma.sync makes each warp load every B fragment into registers with ldmatrix
//   first, 16 x 8 at a time, and on Hopper runs the tensor cores at about two thirds of their rate. wgmma
//   takes B where it lies, described by a 64-bit "descriptor" (its address, its row stride and its swizzle).
// - TMA, the tensor memory accelerator. One thread asks the copy engine for a whole tile with one instruction
//   (cp.async.bulk.tensor). The engine computes every address, writes the tile into shared memory swizzled
//   as wgmma reads it, fills rows past the sequence's end with zeros, and counts the bytes that arrived on an
//   mbarrier. No other thread spends an instruction on a copy.
// - Warp specialisation, as FlashAttention-3 does. A block is one producer warpgroup, which only loads, and
//   CONSUMERS warpgroups, which only compute. Between them is a ring of STAGES tile buffers with two
//   mbarriers each: `full` completes when a stage's bytes have landed, `empty` when every consumer warp is
//   done with it. The producer runs ahead by STAGES tiles while the tensor cores work, and no __syncthreads
//   stalls the block. The producer needs few registers and hands them to the consumers (setmaxnreg), which
//   hold the accumulators.
//
// Each consumer warpgroup owns 64 rows of the block's tile: query rows (forward, dQ) or key rows (dK, dV).
// Warp w of it owns 16 of them, laid out as mma.sync's, so the softmax step and the stores are
// flash_tiles.cuh's. Tiles are 64 rows per copy; q, k, v are read from the qkv buffer (B, T, 3C) and dO from
// (B, T, C) through tensor maps that the launcher (llm/backends/attention.py: HopperFlashAttention) makes,
// 3-dimensional (column, t, b) so that rows past T of one sequence read as zeros.
#include "flash_tiles.cuh"

#ifndef CONSUMERS
#define CONSUMERS 2        // consumer warpgroups per block (the launcher's, per kernel); 64 rows each
#endif
#ifndef STAGES
#define STAGES 3           // tile buffers in the ring between the producer and the consumers
#endif
#ifndef FORWARD_TILE
#define FORWARD_TILE 64    // keys per tile in the forward
#endif
#ifndef BACKWARD_TILE
#define BACKWARD_TILE 64   // keys (dQ) or queries (dK, dV) per tile in the backward
#endif
constexpr int ROWS = 64 * CONSUMERS, THREADS = 128 * (1 + CONSUMERS), COPY_ROWS = 64;
static_assert(FORWARD_TILE % 64 == 0 && BACKWARD_TILE == 64,
              "wgmma's N: 64 columns of scores per instruction");

struct alignas(64) TensorMap {   // CUtensorMap, made on the host by cuTensorMapEncodeTiled
    unsigned long long opaque[16];
};

// ---- Hopper primitives -----------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// This thread's warpgroup and warp, read from lane 0 so that the compiler knows they are the same across
// the warp: wgmma under a branch it thinks divergent is serialized, one instruction at a time.
__device__ __forceinline__ int warpgroup() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }
__device__ __forceinline__ int warp_in_group() { return __shfl_sync(0xffffffffu, threadIdx.x / 32 % 4, 0); }

// An mbarrier counts arrivals and, for copies, bytes; its phase completes when both reach what was expected,
// and waiters name the phase by its parity (0, 1, 0, ...).
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(bar)), "r"(arrivals));
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile("{\n .reg .pred done;\n WAIT:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}\n" :: "r"(smem(bar)), "r"(parity) : "memory");
}

// COPY_ROWS rows of HS columns at (column, t, b) of a tensor map into a tile, counted on bar.
__device__ __forceinline__ void tma_load(bf16* tile, const TensorMap* map, int column, int t, int b,
                                         unsigned long long* bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];"
                 :: "r"(smem(tile)), "l"(map), "r"(column), "r"(t), "r"(b), "r"(smem(bar)) : "memory");
}

// setmaxnreg: the producer warpgroup gives registers up, keeping PRODUCER each, and the consumers take them.
// The pool is what the block got at launch, 65,536 / THREADS each rounded down to 8 (168 with two consumer
// warpgroups): a consumer's share beyond it would wait forever. Each kernel names its PRODUCER once:
// 24 in the forward, whose producer is one thread issuing copies (with two consumer warpgroups they got 240
// instead of 232, 0.372 against 0.389 ms a layer on an H200; its three get 160 either way); 32 in the
// backward's, so that the dK, dV kernel's three consumer warpgroups get 160 (its producer warp, which also
// loads lse and D, spills 20 bytes at 32 and 52 at 24; dQ's three get 160 either way).
constexpr int LAUNCH_REGISTERS = 65536 / THREADS / 8 * 8;
constexpr int FORWARD_PRODUCER = 24, BACKWARD_PRODUCER = 32;
template <int PRODUCER>
__device__ __forceinline__ void registers_down() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(PRODUCER));
}
template <int PRODUCER>
__device__ __forceinline__ void registers_up() {
    constexpr int share = (LAUNCH_REGISTERS * THREADS - 128 * PRODUCER) / (128 * CONSUMERS) / 8 * 8;
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(share < 256 ? share : 256));
}

// A wgmma descriptor of a tile in shared memory: bits 0-13 its address / 16, 16-29 the leading byte offset
// / 16, 32-45 the stride byte offset / 16, 62-63 the swizzle (1: 128 bytes, 2: 64, 3: 32). Rows of a tile
// are SWIZZLE bytes, and 8 of them make one swizzle block: the stride byte offset is 8 * SWIZZLE, the step
// from one block of 8 rows to the next. A tile is one swizzle block wide, so the leading byte offset (the
// step to the next block of columns) is never used. The same tile is read two ways:
//   not transposed: its rows are the product's N and its HS columns the sum's k (K in S = Q K^T); a k-step
//     of 16 moves 32 bytes along the rows, + 2 in the address field
//   transposed: its rows are the sum's k and its HS columns the product's N (V in O = P V); a k-step of
//     16 moves 16 rows, to the descriptor of the tile 16 rows on
__device__ __forceinline__ unsigned long long descriptor(const bf16* tile) {
    constexpr unsigned long long swizzle = SWIZZLE == 128 ? 1 : SWIZZLE == 64 ? 2 : 3;
    return (smem(tile) & 0x3FFFF) >> 4 | 1ull << 16 | (unsigned long long)(8 * SWIZZLE >> 4) << 32
           | swizzle << 62;
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Wait until at most PENDING of this warpgroup's committed groups of wgmma are still running.
template <int PENDING = 0>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(PENDING) : "memory");
}
// After the wait that completes an accumulator, before anything reads it (every such read in this file):
// the compiler sees its registers change here, so that it moves no read of them above the wait (it cannot
// know when an asynchronous wgmma writes them).
template <int N>
__device__ __forceinline__ void settle(float acc[][4]) {
    #pragma unroll
    for (int n = 0; n < N / 8; n++)
        asm volatile("" : "+f"(acc[n][0]), "+f"(acc[n][1]), "+f"(acc[n][2]), "+f"(acc[n][3]) :: "memory");
}

// acc (64 x N, this warp's 16 rows as flash_tiles.cuh lays out a C tile) (+)= A (64 x 16, the warp's
// fragment a) times B (16 x N) read through descriptor b; TRANS says which way B lies (see descriptor()).
// accumulate = 0 overwrites acc. The warpgroup's 4 warps issue it together; it runs asynchronously until
// wgmma_wait().
// The operand list of a 64 x 64 accumulator (32 floats a thread), in both forms of m64n64k16 below.
#define ACC64_LIST " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
                   " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
#define ACC8(i) "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3]), \
                "+f"(acc[i + 1][0]), "+f"(acc[i + 1][1]), "+f"(acc[i + 1][2]), "+f"(acc[i + 1][3])
template <int N, int TRANS>
__device__ __forceinline__ void wgmma(float acc[][4], const unsigned a[4], unsigned long long b,
                                      int accumulate) {
    if constexpr (N == 16) {
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %14, 0;\n"
                     " wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
                     " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %13;\n}\n"
                     : ACC8(0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS), "r"(accumulate));
    } else if constexpr (N == 32) {
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %22, 0;\n"
                     " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"
                     " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15},"
                     " {%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"
                     : ACC8(0), ACC8(2)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS), "r"(accumulate));
    } else {
        static_assert(N == 64, "wgmma here: N = 16, 32 or 64");
        asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %38, 0;\n"
                     " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
                     ACC64_LIST
                     " {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                     : ACC8(0), ACC8(2), ACC8(4), ACC8(6)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS), "r"(accumulate));
    }
}

// The same product with A read from shared memory as well, through descriptor a: a tile of the
// warpgroup's 64 rows, its HS columns the sum's k (each k-step + 2, as B's). Here only for N = 64, B not
// transposed (S^T = K Q^T and dP^T = V dO^T in the dK, dV kernel).
template <int N, int TRANS>
__device__ __forceinline__ void wgmma(float acc[][4], unsigned long long a, unsigned long long b,
                                      int accumulate) {
    static_assert(N == 64 && TRANS == 0, "A from shared memory: N = 64, B not transposed");
    asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
                 " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
                 ACC64_LIST
                 " %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : ACC8(0), ACC8(2), ACC8(4), ACC8(6)
                 : "l"(a), "l"(b), "r"(accumulate));
}

// A's k-step kk: the fragments of a warp's 16 rows in registers, or a tile of the warpgroup's 64 rows.
__device__ __forceinline__ const unsigned* k_step(const unsigned a[][4], int kk) { return a[kk]; }
__device__ __forceinline__ unsigned long long k_step(const bf16* rows, int kk) {
    return descriptor(rows) + 2 * kk;
}

// acc (16 x N per warp) = A rows (HS columns: fragments, or a tile in shared memory) times tile^T, tile N
// rows of HS: S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T. One instruction per 64 rows of the tile
// and per k-step of 16.
template <int N, typename Rows>
__device__ __forceinline__ void rows_times_tile_t(float acc[][4], Rows a, const bf16* tile) {
    #pragma unroll
    for (int n = 0; n < N / 64; n++)
        #pragma unroll
        for (int kk = 0; kk < HS / 16; kk++)
            wgmma<64, 0>(acc + 8 * n, k_step(a, kk), descriptor(tile + n * 64 * HS) + 2 * kk, kk);
}

// acc (16 x HS per warp) += P times tile (K rows of HS), P given as its bf16 A fragments: O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q. The fragments are all made first (to_fragments), then one
// wgmma_fence(), so that the instructions run back to back: a register that changes between two wgmma makes
// the compiler fence each one.
template <int K>
__device__ __forceinline__ void to_fragments(unsigned a[][4], const float p[][4]) {
    #pragma unroll
    for (int kk = 0; kk < K / 16; kk++) a_fragment(a[kk], p, kk);
}

template <int K>
__device__ __forceinline__ void fragments_times_tile(float acc[][4], const unsigned a[][4],
                                                     const bf16* tile) {
    #pragma unroll
    for (int kk = 0; kk < K / 16; kk++) wgmma<HS, 1>(acc, a[kk], descriptor(tile + 16 * kk * HS), 1);
}

// The block's shared memory, 1024-byte aligned (where the swizzle pattern starts) by align_smem(); its size
// is exported for the launcher, which reads it rather than computing it again.
template <typename Layout>
__device__ __forceinline__ Layout& align_smem() {
    extern __shared__ unsigned char raw[];
    return *reinterpret_cast<Layout*>(raw + ((1024 - (smem(raw) & 1023)) & 1023));
}

__device__ __forceinline__ void init_ring(unsigned long long* full, unsigned long long* empty,
                                          unsigned full_arrivals) {
    for (int s = 0; s < STAGES; s++) {
        mbar_init(&full[s], full_arrivals);
        mbar_init(&empty[s], 4 * CONSUMERS);   // one arrival per consumer warp
    }
}

// Before the producer refills stage j % STAGES with tile j, every consumer warp is done with tile j - STAGES.
__device__ __forceinline__ void wait_empty(unsigned long long* empty, int j) {
    if (j >= STAGES) mbar_wait(&empty[j % STAGES], (j / STAGES - 1) & 1);
}

// One arrival per warp on bar, once all its lanes are done with what bar guards.
__device__ __forceinline__ void warp_arrive(unsigned long long* bar) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(bar);
}

__device__ __forceinline__ void release(unsigned long long* empty, int j) { warp_arrive(&empty[j % STAGES]); }

// The kernels are persistent: one block per SM (the launcher's grid) walks the work items, each ROWS rows of
// one head, with a stride of gridDim.x, so that while a block's consumers finish one item its producer
// already loads the next one's tiles: a block's start-up (barriers, the first copies' latency) is paid once
// per SM, not once per item. The ring's position g runs on from item to item, and the rows every item keeps
// (Q, or K and V) have a buffer of their own with two barriers, `held_full` and `held_empty`, turned once
// per item. Items come in groups of GROUP_HEADS heads, within a group by row tile, the tiles with the most
// causal work first, so that a head's streamed tiles are read again from L2 by its next row tile: at T =
// 1024 and hs = 64, 64 heads' K and V (or Q and dO) are 16 MB, and L2 holds 50. Measured in the d12 B=64
// training step on an H200, the three kernels took 19.1 ms with groups of 64 heads (19.3 with 4, 21.1 with
// 16, 20.4 with all heads as one group), against 21.8 for one block per item, not persistent (another call).
#ifndef GROUP_HEADS
#define GROUP_HEADS 64
#endif
struct Item {
    int row0, b, h, bh;
};
__device__ __forceinline__ Item work_item(int it, int heads, int NH, int row_tiles, bool last_rows_first) {
    const int group = it / (GROUP_HEADS * row_tiles), in_group = it % (GROUP_HEADS * row_tiles);
    const int group_heads = min(GROUP_HEADS, heads - group * GROUP_HEADS);
    const int tile = in_group / group_heads, bh = group * GROUP_HEADS + in_group % group_heads;
    return {(last_rows_first ? row_tiles - 1 - tile : tile) * ROWS, bh / NH, bh % NH, bh};
}

// ---- forward -------------------------------------------------------------------------------------------
// Items are ROWS query rows of one head, the last rows (which see the most keys) first. Consumer c owns
// query rows row0 + 64c ...; it walks the key tiles up to its diagonal as flash_forward of
// flash_attention.cu does, with S = Q K^T and O += P V each a few wgmma instructions, and one step out of
// phase: S_j goes to the tensor cores before P_{j-1} V_{j-1}, so that the softmax of S_j (exponentials, on
// the special-function units) runs while the tensor cores still work on P V. A tile past a warpgroup's
// diagonal is only waited for and released, so that the producer's ring keeps turning. The launcher gives
// the forward three consumer warpgroups and key tiles of 64: 192 rows share each tile of K and V, and a
// consumer's S, P and O fit its 160 registers (with tiles of 128 they spill). When T is not a multiple of
// 192, a head's last item has warpgroups whose rows all lie past T: they skip the products, so that the
// block's other warpgroups have the tensor cores to themselves (while they ran them on rows of zeros, three
// consumers were slower than two).
struct ForwardSmem {
    bf16 q[ROWS * HS], k[STAGES][FORWARD_TILE * HS], v[STAGES][FORWARD_TILE * HS];
    unsigned long long held_full, held_empty, full[STAGES], empty[STAGES];
};
extern "C" __device__ int flash_forward_smem = sizeof(ForwardSmem) + 1024;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_forward(bf16* out, float* lse, const __grid_constant__ TensorMap qkv_map, int T, int NH, int heads,
              float scale) {
    ForwardSmem& sm = align_smem<ForwardSmem>();
    const int C = NH * HS, row_tiles = (T + ROWS - 1) / ROWS, items = row_tiles * heads;
    if (threadIdx.x == 0) {
        mbar_init(&sm.held_full, 1);
        mbar_init(&sm.held_empty, 4 * CONSUMERS);
        init_ring(sm.full, sm.empty, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");   // visible to the copy engine
    }
    __syncthreads();

    if (warpgroup() == 0) {   // the producer
        registers_down<FORWARD_PRODUCER>();
        if (threadIdx.x == 0)
            for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
                const Item w = work_item(it, heads, NH, row_tiles, true);
                const int tiles = min(w.row0 + ROWS - 1, T - 1) / FORWARD_TILE + 1;
                if (n > 0) mbar_wait(&sm.held_empty, (n - 1) & 1);   // the last item's Q is in registers
                mbar_arrive_expect_bytes(&sm.held_full, ROWS * HS * 2);
                for (int r = 0; r < ROWS; r += COPY_ROWS)
                    tma_load(sm.q + r * HS, &qkv_map, w.h * HS, w.row0 + r, w.b, &sm.held_full);
                for (int j = 0; j < tiles; j++, g++) {
                    const int s = g % STAGES;
                    wait_empty(sm.empty, g);
                    mbar_arrive_expect_bytes(&sm.full[s], 2 * FORWARD_TILE * HS * 2);
                    for (int r = 0; r < FORWARD_TILE; r += COPY_ROWS) {
                        tma_load(sm.k[s] + r * HS, &qkv_map, C + w.h * HS, j * FORWARD_TILE + r, w.b,
                                 &sm.full[s]);
                        tma_load(sm.v[s] + r * HS, &qkv_map, 2 * C + w.h * HS, j * FORWARD_TILE + r, w.b,
                                 &sm.full[s]);
                    }
                }
            }
        return;
    }
    registers_up<FORWARD_PRODUCER>();
    const int c = warpgroup() - 1, warp = warp_in_group();
    const float scale_log2 = scale * LOG2E;
    for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
        const Item w = work_item(it, heads, NH, row_tiles, true);
        const int tiles = min(w.row0 + ROWS - 1, T - 1) / FORWARD_TILE + 1;   // up to the item's diagonal
        const int first_row = w.row0 + 64 * c, row0 = first_row + 16 * warp;
        // up to this warpgroup's diagonal; none for a warpgroup whose rows all lie past T (the last item of a
        // head when T is not a multiple of ROWS), which only turns the ring
        const int my_tiles = first_row < T ? min(tiles, (first_row + 63) / FORWARD_TILE + 1) : 0;
        mbar_wait(&sm.held_full, n & 1);
        unsigned qf[HS / 16][4];
        load_rows(qf, sm.q, 64 * c + 16 * warp);
        warp_arrive(&sm.held_empty);

        float o[HS / 8][4] = {}, m[2] = {-INF, -INF}, l[2] = {0.0f, 0.0f}, s[FORWARD_TILE / 8][4], rescale[2];
        unsigned p[FORWARD_TILE / 16][4];   // P_{j-1}, rounded to bf16 fragments
        if (my_tiles > 0) {
            mbar_wait(&sm.full[g % STAGES], (g / STAGES) & 1);          // S_0 alone
            wgmma_fence();
            rows_times_tile_t<FORWARD_TILE>(s, qf, sm.k[g % STAGES]);
            wgmma_commit();
            wgmma_wait();
            settle<FORWARD_TILE>(s);
            softmax_step<FORWARD_TILE>(s, m, l, rescale, row0, 0, scale_log2);
            to_fragments<FORWARD_TILE>(p, s);
            for (int j = 1; j < my_tiles; j++) {
                const int ring = g + j;
                mbar_wait(&sm.full[ring % STAGES], (ring / STAGES) & 1);
                wgmma_fence();
                rows_times_tile_t<FORWARD_TILE>(s, qf, sm.k[ring % STAGES]);            // S_j = Q K_j^T
                wgmma_commit();
                fragments_times_tile<FORWARD_TILE>(o, p, sm.v[(ring - 1) % STAGES]);   // O += P_{j-1} V_{j-1}
                wgmma_commit();
                wgmma_wait<1>();   // S_j is done; its softmax runs while P V still does
                settle<FORWARD_TILE>(s);
                softmax_step<FORWARD_TILE>(s, m, l, rescale, row0, j * FORWARD_TILE, scale_log2);
                wgmma_wait();
                settle<HS>(o);
                release(sm.empty, ring - 1);
                rescale_rows(o, rescale);   // O to S_j's max, now that P V no longer writes it
                to_fragments<FORWARD_TILE>(p, s);
            }
            wgmma_fence();
            fragments_times_tile<FORWARD_TILE>(o, p, sm.v[(g + my_tiles - 1) % STAGES]);
            wgmma_commit();
            wgmma_wait();
            settle<HS>(o);
            release(sm.empty, g + my_tiles - 1);
        }
        for (int j = my_tiles; j < tiles; j++) {   // past the diagonal: let the producer reuse the stage
            mbar_wait(&sm.full[(g + j) % STAGES], ((g + j) / STAGES) & 1);
            release(sm.empty, g + j);
        }
        g += tiles;
        if (my_tiles == 0) continue;
        float inv_l[2];
        finish_softmax(lse + (long long)w.bh * T, row0, T, m, l, inv_l);
        store_rows(out + (long long)w.b * T * C + w.h * HS, C, row0, T, o, inv_l);
    }
}

// ---- backward ------------------------------------------------------------------------------------------
// The dQ kernel runs first and writes D = rowsum(dO * out), as flash_attention.cu's does.
//
// dK and dV of items of ROWS keys, the first keys (which see the most queries) first. Consumer c owns keys
// row0 + 64c ...; the producer streams the query tiles from the diagonal down (Q and dO by the copy engine,
// their lse and D by the producer warp's own loads). Per tile, as flash_backward_dkv:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T - lse), dS^T = P^T * (dP^T - D), dV += P^T dO, dK += dS^T Q.
// Within a tile, each product is its own commit group, so that a warpgroup waits only for the one it needs
// next: P's exponentials run while dP is made, dS while dV is (both kernels: 1.00-1.02 against 1.06-1.08 ms
// a layer at GPT-2 124M, B=64, on an H100). Across tiles they are not put out of phase as the forward's:
// that made both kernels slower (1.18 against 1.13 ms on an H200; the next tile's S and dP issued behind dK
// or dQ, before any wait, 1.25 against 1.00-1.04 on an H100). The consumer warpgroups fill each other's gaps.
// K and V stay in shared memory, read there by S^T's and dP^T's wgmma, not in registers as dQ's Q and dO:
// that leaves each consumer room for the products within the 160 registers of three consumer warpgroups
// (with K and V in registers, three spilled 260 bytes), and three fill the tensor cores' gaps better than
// two (Nsight Compute, H100: 665-672 against 701 us a layer; two with K and V in shared memory, 5% slower
// than in registers). The item's K and V have two buffers, so that the producer loads the next item's
// while this one's are still read.
struct DkvSmem {
    bf16 k[2][ROWS * HS], v[2][ROWS * HS], q[STAGES][BACKWARD_TILE * HS], dout[STAGES][BACKWARD_TILE * HS];
    float lse[STAGES][BACKWARD_TILE], D[STAGES][BACKWARD_TILE];
    unsigned long long held_full[2], held_empty[2], full[STAGES], empty[STAGES];
};
extern "C" __device__ int flash_backward_dkv_smem = sizeof(DkvSmem) + 1024;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_backward_dkv(bf16* dqkv, float* bias_sums, const __grid_constant__ TensorMap dout_map,
                   const __grid_constant__ TensorMap qkv_map,
                   const float* lse, const float* D, int T, int NH, int heads, float scale) {
    DkvSmem& sm = align_smem<DkvSmem>();
    const float scale_log2 = scale * LOG2E;
    const int C = NH * HS, row_tiles = (T + ROWS - 1) / ROWS, items = row_tiles * heads;
    const int tiles = (T + BACKWARD_TILE - 1) / BACKWARD_TILE;
    if (threadIdx.x == 0) {
        for (int h = 0; h < 2; h++) {
            mbar_init(&sm.held_full[h], 1);
            mbar_init(&sm.held_empty[h], 4 * CONSUMERS);
        }
        init_ring(sm.full, sm.empty, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup() == 0) {   // the producer: warp 0
        registers_down<BACKWARD_PRODUCER>();
        if (threadIdx.x >= 32) return;
        const int lane = threadIdx.x;
        for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
            // the first keys first: they see the most queries
            const Item w = work_item(it, heads, NH, row_tiles, false);
            if (lane == 0) {   // item n's K and V into buffer n % 2, once item n - 2 is done with it
                const int h = n % 2;
                if (n >= 2) mbar_wait(&sm.held_empty[h], (n / 2 - 1) & 1);
                mbar_arrive_expect_bytes(&sm.held_full[h], 2 * ROWS * HS * 2);
                for (int r = 0; r < ROWS; r += COPY_ROWS) {
                    tma_load(sm.k[h] + r * HS, &qkv_map, C + w.h * HS, w.row0 + r, w.b, &sm.held_full[h]);
                    tma_load(sm.v[h] + r * HS, &qkv_map, 2 * C + w.h * HS, w.row0 + r, w.b,
                             &sm.held_full[h]);
                }
            }
            const float* lse_row = lse + (long long)w.bh * T;
            const float* D_row = D + (long long)w.bh * T;
            for (int i = w.row0 / BACKWARD_TILE; i < tiles; i++, g++) {
                const int s = g % STAGES, t0 = i * BACKWARD_TILE;
                wait_empty(sm.empty, g);
                // rows past T read as lse = 0 and D = 0: their dO and Q are 0 too, so they add nothing
                for (int r = lane; r < BACKWARD_TILE; r += 32) {
                    sm.lse[s][r] = t0 + r < T ? lse_row[t0 + r] : 0.0f;
                    sm.D[s][r] = t0 + r < T ? D_row[t0 + r] : 0.0f;
                }
                __syncwarp();   // the lanes' stores come before lane 0's arrival, which publishes them
                if (lane == 0) {
                    mbar_arrive_expect_bytes(&sm.full[s], 2 * BACKWARD_TILE * HS * 2);
                    tma_load(sm.q[s], &qkv_map, w.h * HS, t0, w.b, &sm.full[s]);
                    tma_load(sm.dout[s], &dout_map, w.h * HS, t0, w.b, &sm.full[s]);
                }
            }
        }
        return;
    }
    registers_up<BACKWARD_PRODUCER>();
    const int c = warpgroup() - 1, warp = warp_in_group();
    for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
        const Item w = work_item(it, heads, NH, row_tiles, false);
        const int first = w.row0 / BACKWARD_TILE, first_key = w.row0 + 64 * c, key0 = first_key + 16 * warp;
        const bf16 *k_rows = sm.k[n % 2] + 64 * c * HS, *v_rows = sm.v[n % 2] + 64 * c * HS;
        mbar_wait(&sm.held_full[n % 2], (n / 2) & 1);

        float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
        for (int i = first; i < tiles; i++, g++) {
            const int s = g % STAGES, t0 = i * BACKWARD_TILE;
            mbar_wait(&sm.full[s], (g / STAGES) & 1);
            if (t0 + BACKWARD_TILE - 1 >= first_key) {
                // four products in three steps: P^T's exponentials run while the tensor cores make dP^T,
                // and dS^T is made while they add P^T dO into dV
                float p[BACKWARD_TILE / 8][4], dp[BACKWARD_TILE / 8][4];
                unsigned pf[BACKWARD_TILE / 16][4], dsf[BACKWARD_TILE / 16][4];
                wgmma_fence();
                rows_times_tile_t<BACKWARD_TILE>(p, k_rows, sm.q[s]);
                wgmma_commit();
                rows_times_tile_t<BACKWARD_TILE>(dp, v_rows, sm.dout[s]);
                wgmma_commit();
                wgmma_wait<1>();
                settle<BACKWARD_TILE>(p);
                column_probabilities<BACKWARD_TILE>(p, key0, t0, scale_log2, sm.lse[s]);
                to_fragments<BACKWARD_TILE>(pf, p);
                wgmma_fence();
                fragments_times_tile<BACKWARD_TILE>(dv, pf, sm.dout[s]);
                wgmma_commit();
                wgmma_wait<1>();
                settle<BACKWARD_TILE>(dp);
                column_score_gradients<BACKWARD_TILE>(dp, p, sm.D[s]);
                to_fragments<BACKWARD_TILE>(dsf, dp);
                wgmma_fence();
                fragments_times_tile<BACKWARD_TILE>(dk, dsf, sm.q[s]);
                wgmma_commit();
                wgmma_wait();
            }
            release(sm.empty, g);
        }
        warp_arrive(&sm.held_empty[n % 2]);   // every product that read K and V is done
        settle<HS>(dk);   // after the last tile's wait
        settle<HS>(dv);
        store_gradient(dqkv, bias_sums, 1, w.b, w.h, C, key0, T, dk, scale);
        store_gradient(dqkv, bias_sums, 2, w.b, w.h, C, key0, T, dv, 1.0f);
    }
}

// dQ of items of ROWS queries, the last first, and their D. Consumer c owns queries row0 + 64c ... and keeps
// its rows of Q and dO in registers (out passes through them for D); the producer streams the key tiles up
// to the diagonal. Per tile, as flash_backward_dq: S = Q K^T, dP = dO V^T, P = exp(S - lse),
// dS = P * (dP - D), dQ += dS K.
struct DqSmem {
    bf16 q[ROWS * HS], dout[ROWS * HS], out[ROWS * HS], k[STAGES][BACKWARD_TILE * HS],
        v[STAGES][BACKWARD_TILE * HS];
    unsigned long long held_full, held_empty, full[STAGES], empty[STAGES];
};
extern "C" __device__ int flash_backward_dq_smem = sizeof(DqSmem) + 1024;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_backward_dq(bf16* dqkv, float* bias_sums, const __grid_constant__ TensorMap dout_map,
                  const __grid_constant__ TensorMap out_map, const __grid_constant__ TensorMap qkv_map,
                  const float* lse, float* D, int T, int NH, int heads, float scale) {
    DqSmem& sm = align_smem<DqSmem>();
    const int C = NH * HS, row_tiles = (T + ROWS - 1) / ROWS, items = row_tiles * heads;
    if (threadIdx.x == 0) {
        mbar_init(&sm.held_full, 1);
        mbar_init(&sm.held_empty, 4 * CONSUMERS);
        init_ring(sm.full, sm.empty, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (warpgroup() == 0) {   // the producer
        registers_down<BACKWARD_PRODUCER>();
        if (threadIdx.x == 0)
            for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
                const Item w = work_item(it, heads, NH, row_tiles, true);
                const int tiles = min(w.row0 + ROWS - 1, T - 1) / BACKWARD_TILE + 1;
                if (n > 0) mbar_wait(&sm.held_empty, (n - 1) & 1);
                mbar_arrive_expect_bytes(&sm.held_full, 3 * ROWS * HS * 2);
                for (int r = 0; r < ROWS; r += COPY_ROWS) {
                    tma_load(sm.q + r * HS, &qkv_map, w.h * HS, w.row0 + r, w.b, &sm.held_full);
                    tma_load(sm.dout + r * HS, &dout_map, w.h * HS, w.row0 + r, w.b, &sm.held_full);
                    tma_load(sm.out + r * HS, &out_map, w.h * HS, w.row0 + r, w.b, &sm.held_full);
                }
                for (int j = 0; j < tiles; j++, g++) {
                    const int s = g % STAGES;
                    wait_empty(sm.empty, g);
                    mbar_arrive_expect_bytes(&sm.full[s], 2 * BACKWARD_TILE * HS * 2);
                    tma_load(sm.k[s], &qkv_map, C + w.h * HS, j * BACKWARD_TILE, w.b, &sm.full[s]);
                    tma_load(sm.v[s], &qkv_map, 2 * C + w.h * HS, j * BACKWARD_TILE, w.b, &sm.full[s]);
                }
            }
        return;
    }
    registers_up<BACKWARD_PRODUCER>();
    const int c = warpgroup() - 1, warp = warp_in_group();
    const float scale_log2 = scale * LOG2E;
    for (int it = blockIdx.x, n = 0, g = 0; it < items; it += gridDim.x, n++) {
        const Item w = work_item(it, heads, NH, row_tiles, true);
        const int tiles = min(w.row0 + ROWS - 1, T - 1) / BACKWARD_TILE + 1;
        const int first_row = w.row0 + 64 * c, row0 = first_row + 16 * warp;
        float L[2], Drow[2];
        row_lse(L, lse + (long long)w.bh * T, row0, T);   // in flight while the rows land
        mbar_wait(&sm.held_full, n & 1);
        unsigned qf[HS / 16][4], dof[HS / 16][4], of[HS / 16][4];
        load_rows(qf, sm.q, 64 * c + 16 * warp);
        load_rows(dof, sm.dout, 64 * c + 16 * warp);
        load_rows(of, sm.out, 64 * c + 16 * warp);
        warp_arrive(&sm.held_empty);
        row_D(Drow, D + (long long)w.bh * T, row0, T, dof, of);

        float dq[HS / 8][4] = {};
        for (int j = 0; j < tiles; j++, g++) {
            const int s = g % STAGES, k0 = j * BACKWARD_TILE;
            mbar_wait(&sm.full[s], (g / STAGES) & 1);
            // up to this warpgroup's diagonal; nothing for one whose rows all lie past T (the forward's comment
            // says why). P's exponentials run while the tensor cores make dP.
            if (first_row < T && k0 <= first_row + 63) {
                float p[BACKWARD_TILE / 8][4], dp[BACKWARD_TILE / 8][4];
                wgmma_fence();
                rows_times_tile_t<BACKWARD_TILE>(p, qf, sm.k[s]);
                wgmma_commit();
                rows_times_tile_t<BACKWARD_TILE>(dp, dof, sm.v[s]);
                wgmma_commit();
                wgmma_wait<1>();
                settle<BACKWARD_TILE>(p);
                row_probabilities<BACKWARD_TILE>(p, row0, k0, scale_log2, L);
                wgmma_wait();
                settle<BACKWARD_TILE>(dp);
                row_score_gradients<BACKWARD_TILE>(dp, p, Drow);
                unsigned dsf[BACKWARD_TILE / 16][4];
                to_fragments<BACKWARD_TILE>(dsf, dp);
                wgmma_fence();
                fragments_times_tile<BACKWARD_TILE>(dq, dsf, sm.k[s]);
                wgmma_commit();
                wgmma_wait();
            }
            release(sm.empty, g);
        }
        settle<HS>(dq);   // after the last tile's wait
        store_gradient(dqkv, bias_sums, 0, w.b, w.h, C, row0, T, dq, scale);
    }
}
