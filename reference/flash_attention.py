"""FlashAttention-2 in NumPy: the attention of attention.py, computed tile by tile as the GPU kernels do.

The result is the same (out = softmax(q k^T * scale, causal) v); what changes is the order of the work. The
naive attention_forward builds the whole (T, T) score matrix per head, takes its softmax, and keeps the (T, T)
probabilities att for the backward. On a GPU that matrix lives in slow global memory, and for long T it is
the largest tensor of the layer. FlashAttention never forms it:

- A *tile* is a block of the (T, T) score matrix: BQ query rows i0 <= i < i1 against BK key columns
  j0 <= j < j1. A tile of scores is q[i0:i1] k[j0:j1]^T, small enough for fast on-chip memory. Here it is a
  (B, NH, BQ, BK) array; on the GPU one thread block owns one tile's rows of one (b, head).
- Causal: query row i sees keys j <= i. A key tile whose first key j0 lies past the query tile's last row
  i1 - 1 sits wholly above the diagonal and is never visited; a tile that crosses the diagonal is masked.
- The softmax over a row needs that row's max and sum over *all* its keys, which a tile does not have. The
  forward keeps per row a running max m, a running sum l of exp(s - m) and an unnormalized output acc, and
  corrects them as later tiles come (the online softmax). The backward recomputes each tile of probabilities
  from q, k and one number per row, the log-sum-exp lse, instead of reading them back.

One function per kernel of llm/backends/kernels/flash_attention.cu, with its name and its loops:
    flash_forward        one query tile after another; inside, the key tiles up to the diagonal
    flash_backward_dq    one query tile after another; inside, the key tiles up to the diagonal: dQ
    flash_backward_dkv   one key tile after another; inside, the query tiles that see it: dK, dV
and flash_backward_dot, D = rowsum(dO * out), which the dQ kernel takes for its rows before its loop and
writes for the dK, dV kernel; flash_backward runs them in the order the backend launches them. Each
gradient is summed by one loop in one order, and no two tiles add into the same rows: the kernels need no
atomics.

Layout as in attention.py: qkv (B, T, 3C) holds q, k, v back to back at each position; NH heads of
hs = C / NH. Every array is in the dtype of qkv (the kernels keep lse and D in fp32). The loops run over
tiles only; B and NH are vectorized, as the kernels' grids give each (b, head) its own blocks.
"""
import math

import numpy as np

from .attention import merge_heads, split_heads


def future(i0, i1, j0, j1):
    """(i1 - i0, j1 - j0) bool: True where key j comes after query i (j > i), what the causal mask removes.

    All False for a tile on or below the diagonal (j1 - 1 <= i0); the kernels test that case (their
    `diagonal` flag) to skip the comparison, which changes nothing in the result."""
    return np.arange(j0, j1)[None, :] > np.arange(i0, i1)[:, None]


def flash_forward(qkv, NH, BQ=64, BK=64):
    """qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T): log sum_j exp(s_ij) of each row's scores.

    The online softmax. After the key tiles 0..n of row i have been seen, with s_j = q_i . k_j * scale:
        m = max_j s_j,   l = sum_j exp(s_j - m),   acc = sum_j exp(s_j - m) v_j     (j over the tiles seen)
    A new tile brings its scores; the new max is m' = max(m, max of the tile). Multiplying l and acc by
    exp(m - m') turns every old term exp(s_j - m) into exp(s_j - m'), so the three equations hold again
    with m', and the tile's own terms exp(s_j - m') are added. Nothing is approximated: at the end
        acc / l = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m) = sum_j softmax(s)_j v_j
    since the common factor exp(-m) cancels. The max is there only so that exp never sees a positive
    argument and cannot overflow, the same reason attention_forward subtracts the row max. (The kernel works
    in base 2: it multiplies the scores by log2(e) once and calls exp2, the same numbers.)

    For the backward only out and lse are kept, (B, NH, T) numbers instead of the (B, NH, T, T) att: every
        P_ij = exp(s_ij - m) / l = exp(s_ij - (m + log l)) = exp(s_ij - lse_i)
    so a tile of probabilities is recomputed exactly from q, k and lse, at the cost of one more q k^T."""
    q, k, v = split_heads(qkv, NH)                                     # each (B, NH, T, hs)
    B, _, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    out = np.empty_like(q)                                             # (B, NH, T, hs)
    lse = np.empty((B, NH, T), dtype=q.dtype)
    # the kernel starts the last query tiles first (they see the most keys); the order changes nothing here
    for i0 in range(0, T, BQ):                                         # one query tile: rows i0 <= i < i1
        i1 = min(i0 + BQ, T)
        m = np.full((B, NH, i1 - i0), -np.inf, dtype=q.dtype)        # running row max
        l = np.zeros((B, NH, i1 - i0), dtype=q.dtype)                # running sum of exp(s - m)
        acc = np.zeros((B, NH, i1 - i0, hs), dtype=q.dtype)          # running sum of exp(s - m) v
        for j0 in range(0, i1, BK):                                    # key tiles up to the diagonal
            j1 = min(j0 + BK, T)
            s = q[:, :, i0:i1] @ k[:, :, j0:j1].swapaxes(-1, -2) * scale   # S, (B, NH, bq, bk)
            s = np.where(future(i0, i1, j0, j1), -np.inf, s)          # exp(-inf) = 0: masked p is 0
            m_new = np.maximum(m, s.max(axis=-1))                      # finite: tile 0 holds key 0
            p = np.exp(s - m_new[..., None])                          # (B, NH, bq, bk)
            alpha = np.exp(m - m_new)                                  # <= 1; 0 on the first tile
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v[:, :, j0:j1]          # (B, NH, bq, hs)
            m = m_new
        out[:, :, i0:i1] = acc / l[..., None]
        lse[:, :, i0:i1] = m + np.log(l)
    return merge_heads(out), lse


def flash_backward_dot(dout, out, NH):
    """dout (B, T, C), out (B, T, C) -> D (B, NH, T) = rowsum(dO * O) per head (the dQ kernel's, row by row).

    The softmax backward subtracts from each row of dP its P-weighted mean, D_i = sum_j P_ij dP_ij. That sum
    runs over the whole row, which one tile does not hold. But it does not need P at all, because O = P V:
        D_i = sum_j P_ij dP_ij = sum_j P_ij sum_c dO_ic V_jc = sum_c dO_ic sum_j P_ij V_jc = sum_c dO_ic O_ic
    so it is one pass over hs channels, before the tiles."""
    B, T, C = dout.shape
    hs = C // NH
    return (dout * out).reshape(B, T, NH, hs).sum(axis=-1).transpose(0, 2, 1)   # (B, NH, T)


def flash_backward_dkv(dout, qkv, lse, D, NH, BQ=64, BK=64):
    """dout (B, T, C), qkv, lse and D (B, NH, T) -> dk, dv, each (B, NH, T, hs).

    With S = q k^T * scale, P = exp(S - lse), dP = dO V^T and dS = P * (dP - D) (the softmax backward):
        dV = P^T dO,   dK = dS^T Q * scale
    Row j of dK and dV sums over the queries i >= j that see key j. So the outer loop runs over key tiles,
    the inner one over the query tiles from the one holding row j0 to the end, and a key tile's dK and dV
    are complete when its inner loop ends. The tiles are taken transposed, keys in rows, as the kernel
    computes them (each of its warps owns 16 keys, and its rows of every product stay those keys):
        S^T = K Q^T * scale,  P^T = exp(S^T - lse),  dP^T = V dO^T,  dS^T = P^T * (dP^T - D)
    with lse and D now indexed by column. dK is multiplied by scale once, at the end, as the kernel does."""
    q, k, v = split_heads(qkv, NH)                                     # each (B, NH, T, hs)
    B, _, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    dout = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)           # dO, (B, NH, T, hs)
    dk, dv = np.empty_like(k), np.empty_like(v)
    for j0 in range(0, T, BK):                                         # one key tile: keys j0 <= j < j1
        j1 = min(j0 + BK, T)
        dk_acc = np.zeros((B, NH, j1 - j0, hs), dtype=q.dtype)
        dv_acc = np.zeros((B, NH, j1 - j0, hs), dtype=q.dtype)
        for i0 in range(j0 // BQ * BQ, T, BQ):                        # from the query tile holding row j0
            i1 = min(i0 + BQ, T)
            st = k[:, :, j0:j1] @ q[:, :, i0:i1].swapaxes(-1, -2) * scale   # S^T, (B, NH, bk, bq)
            st = np.where(future(i0, i1, j0, j1).T, -np.inf, st)
            pt = np.exp(st - lse[:, :, None, i0:i1])                  # P^T: the forward's, exactly
            do = dout[:, :, i0:i1]                                     # (B, NH, bq, hs)
            dpt = v[:, :, j0:j1] @ do.swapaxes(-1, -2)                # dP^T, (B, NH, bk, bq)
            dst = pt * (dpt - D[:, :, None, i0:i1])                   # dS^T; 0 where masked (p = 0)
            dv_acc += pt @ do                                          # (B, NH, bk, hs)
            dk_acc += dst @ q[:, :, i0:i1]                             # (B, NH, bk, hs)
        dk[:, :, j0:j1] = dk_acc * scale
        dv[:, :, j0:j1] = dv_acc
    return dk, dv


def flash_backward_dq(dout, qkv, lse, D, NH, BQ=64, BK=64):
    """dout (B, T, C), qkv, lse and D (B, NH, T) -> dq (B, NH, T, hs).

        dQ = dS K * scale,   dS = P * (dP - D),   P = exp(S - lse),   dP = dO V^T
    Row i of dQ sums over the keys j <= i that query i sees: the loops of the forward, query tiles outside,
    the key tiles up to the diagonal inside. The kernel recomputes S and dP here rather than have the dK/dV
    pass add into dQ from every key tile: on a GPU, with the key tiles running in parallel, that would take
    atomic adds, and a sum in no fixed order."""
    q, k, v = split_heads(qkv, NH)                                     # each (B, NH, T, hs)
    B, _, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    dout = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)           # dO, (B, NH, T, hs)
    dq = np.empty_like(q)
    for i0 in range(0, T, BQ):                                         # one query tile: rows i0 <= i < i1
        i1 = min(i0 + BQ, T)
        dq_acc = np.zeros((B, NH, i1 - i0, hs), dtype=q.dtype)
        for j0 in range(0, i1, BK):                                    # key tiles up to the diagonal
            j1 = min(j0 + BK, T)
            s = q[:, :, i0:i1] @ k[:, :, j0:j1].swapaxes(-1, -2) * scale   # S, (B, NH, bq, bk)
            s = np.where(future(i0, i1, j0, j1), -np.inf, s)
            p = np.exp(s - lse[:, :, i0:i1, None])                    # P
            dp = dout[:, :, i0:i1] @ v[:, :, j0:j1].swapaxes(-1, -2) # dP, (B, NH, bq, bk)
            ds = p * (dp - D[:, :, i0:i1, None])                      # dS
            dq_acc += ds @ k[:, :, j0:j1]                              # (B, NH, bq, hs)
        dq[:, :, i0:i1] = dq_acc * scale
    return dq


def flash_backward(dout, qkv, out, lse, NH, BQ=64, BK=64):
    """dout (B, T, C) -> dqkv (B, T, 3C), from the forward's out (B, T, C) and lse (B, NH, T).

    The gradients of attention_backward, with P recomputed per tile instead of read from a saved att, in
    the backend's order: D and the dQ pass, then the dK/dV pass."""
    D = flash_backward_dot(dout, out, NH)                              # (B, NH, T)
    dq = flash_backward_dq(dout, qkv, lse, D, NH, BQ, BK)
    dk, dv = flash_backward_dkv(dout, qkv, lse, D, NH, BQ, BK)
    return np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)
