// Token and position embeddings: out[b,t,:] = wte[inp[b,t],:] + wpe[t,:], and its backward.
#include "common.cuh"

// One thread per pack of out: B*T*C/PACK threads, consecutive threads along C.
extern "C" __global__ void encoder_forward(floatX* out, const int* inp, const floatX* wte, const floatX* wpe,
                                           int BT, int T, int C) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int packs = C / PACK;
    if (idx >= (long long)BT * packs) return;
    const int bt = idx / packs, c = (idx % packs) * PACK, t = bt % T;
    const Pack e = load_pack(wte + (long long)inp[bt] * C + c), p = load_pack(wpe + (long long)t * C + c);
    Pack o;
    for (int i = 0; i < PACK; i++) o.v[i] = floatX((float)e.v[i] + (float)p.v[i]);
    store_pack(out + (long long)bt * C + c, o);
}

// dwpe[t,:] += sum over b of dout[b,t,:]. One thread per pack of wpe's first T rows (T*C/PACK threads),
// each summing its column over the B batch rows in float and rounding once.
extern "C" __global__ void encoder_backward_wpe(floatX* dwpe, const floatX* dout, int B, int T, int C) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * (C / PACK)) return;
    const int offset = idx * PACK;  // t * C + c
    float acc[PACK] = {};
    for (int b = 0; b < B; b++) {
        const Pack d = load_pack(dout + (long long)b * T * C + offset);
        for (int i = 0; i < PACK; i++) acc[i] += (float)d.v[i];
    }
    Pack w = load_pack(dwpe + offset);
    for (int i = 0; i < PACK; i++) w.v[i] = floatX((float)w.v[i] + acc[i]);
    store_pack(dwpe + offset, w);
}

// dwte[inp[b,t],:] += dout[b,t,:], without atomics. `order` lists the B*T positions sorted by token
// (a stable sort), so equal tokens form runs. One block per entry of `order`: the block at the start
// of a run sums the run's dout rows in float, in sorted order, and adds them to that token's row once;
// every other block returns at once. Threads of a block split the row into packs. The result does not
// depend on timing: each wte row is written by one block, and its sum always runs in the same order.
extern "C" __global__ void encoder_backward_wte(floatX* dwte, const floatX* dout, const int* inp,
                                               const long long* order, int BT, int C) {
    const int j = blockIdx.x;
    const int token = inp[order[j]];
    if (j > 0 && inp[order[j - 1]] == token) return;
    for (int c = threadIdx.x * PACK; c < C; c += blockDim.x * PACK) {
        float acc[PACK] = {};
        for (int k = j; k < BT && inp[order[k]] == token; k++) {
            const Pack d = load_pack(dout + order[k] * C + c);
            for (int i = 0; i < PACK; i++) acc[i] += (float)d.v[i];
        }
        floatX* row = dwte + (long long)token * C + c;
        Pack w = load_pack(row);
        for (int i = 0; i < PACK; i++) w.v[i] = floatX((float)w.v[i] + acc[i]);
        store_pack(row, w);
    }
}
