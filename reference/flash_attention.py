"""FlashAttention-2 in NumPy: the attention of attention.py, computed tile by tile, for reading.

The result is the same (out = softmax(q k^T * scale, causal) v); what changes is the order of the work. The naive
attention_forward builds the whole (T, T) score matrix per head, takes its softmax, and keeps the (T, T)
probabilities att for the backward. On a GPU that matrix lives in slow global memory, and for long T it is the
largest tensor of the layer. FlashAttention never forms it:

- A *tile* is a block of the (T, T) score matrix: block_q query rows i0 <= i < i1 against block_k key columns
  j0 <= j < j1. A tile of scores is q[i0:i1] k[j0:j1]^T, small enough for fast on-chip memory. Here it is a
  (B, NH, block_q, block_k) array; on a GPU one thread block would own one query tile (one (b, h) each).
- Causal: query row i sees keys j <= i. A tile whose first column j0 lies past the tile's last row i1 - 1 sits
  wholly above the diagonal and is skipped; a tile that crosses the diagonal is masked; one below it is used whole.
- The softmax over a row needs that row's max and sum over *all* its keys, which a tile does not have. The forward
  keeps per row a running max m, a running sum l of exp(s - m) and an unnormalized output acc, and corrects them
  as later tiles come (the online softmax). The backward recomputes each tile of probabilities from q, k and one
  number per row, the log-sum-exp lse, instead of reading them back.

Layout as in attention.py: qkv (B, T, 3C) holds q, k, v back to back at each position; NH heads of hs = C / NH.
Every array is in the dtype of qkv. The loops run over tiles only; B and NH are vectorized.
"""
import math

import numpy as np

from .attention import merge_heads, split_heads


def causal_scores(q, k, i0, i1, j0, j1, scale):
    """The tile of scores q[i0:i1] k[j0:j1]^T * scale, (B, NH, i1 - i0, j1 - j0), with -inf where j > i.

    exp(-inf) = 0, so a masked score gets probability 0 exactly, as in attention_forward. Only a tile that
    crosses the diagonal (its last column j1 - 1 past its first row i0) has anything to mask."""
    s = q[:, :, i0:i1] @ k[:, :, j0:j1].swapaxes(-1, -2) * scale          # (B, NH, bq, bk)
    if j1 - 1 > i0:
        i, j = np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :]
        s = np.where(j <= i, s, -np.inf)                                  # (bq, bk) mask, broadcast over B, NH
    return s


def flash_attention_forward(qkv, NH, block_q=64, block_k=64):
    """qkv (B, T, 3C) -> out (B, T, C), lse (B, NH, T): log sum_j exp(s_ij) of each row's scores.

    The online softmax. After the key tiles 0..n of row i have been seen, with s_j = q_i k_j * scale:
        m = max_j s_j,   l = sum_j exp(s_j - m),   acc = sum_j exp(s_j - m) v_j       (j over the tiles seen)
    A new tile brings its scores; the new max is m' = max(m, max of the tile). Multiplying l and acc by
    exp(m - m') turns every old term exp(s_j - m) into exp(s_j - m'), so the three equations hold again with m',
    and the tile's own terms exp(s_j - m') are added. Nothing is approximated: at the end
        acc / l = sum_j exp(s_j - m) v_j / sum_j exp(s_j - m) = sum_j softmax(s)_j v_j
    since the common factor exp(-m) cancels. The max is there only so that exp never sees a positive argument
    and cannot overflow, the same reason attention_forward subtracts the row max.

    For the backward only out and lse are kept, (B, NH, T) numbers instead of the (B, NH, T, T) att: every
        P_ij = exp(s_ij - m) / l = exp(s_ij - (m + log l)) = exp(s_ij - lse_i)
    so a tile of probabilities is recomputed exactly from q, k and lse, at the cost of one more q k^T."""
    q, k, v = split_heads(qkv, NH)                                      # each (B, NH, T, hs)
    B, _, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    out = np.empty_like(q)                                              # (B, NH, T, hs)
    lse = np.empty((B, NH, T), dtype=q.dtype)
    for i0 in range(0, T, block_q):                                     # one query tile: rows i0 <= i < i1
        i1 = min(i0 + block_q, T)
        m = np.full((B, NH, i1 - i0), -np.inf, dtype=q.dtype)         # running row max
        l = np.zeros((B, NH, i1 - i0), dtype=q.dtype)                 # running sum of exp(s - m)
        acc = np.zeros((B, NH, i1 - i0, hs), dtype=q.dtype)           # running sum of exp(s - m) v
        for j0 in range(0, i1, block_k):                               # key tiles up to the diagonal: j0 <= i1 - 1
            j1 = min(j0 + block_k, T)
            s = causal_scores(q, k, i0, i1, j0, j1, scale)              # (B, NH, bq, bk)
            m_new = np.maximum(m, s.max(axis=-1))                       # finite: tile 0 holds key 0, seen by all
            p = np.exp(s - m_new[..., None])                           # (B, NH, bq, bk), masked entries 0
            alpha = np.exp(m - m_new)                                   # <= 1; exp(-inf) = 0 on the first tile
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ v[:, :, j0:j1]           # (B, NH, bq, hs)
            m = m_new
        out[:, :, i0:i1] = acc / l[..., None]
        lse[:, :, i0:i1] = m + np.log(l)
    return merge_heads(out), lse


def flash_attention_backward(dout, qkv, out, lse, NH, block_q=64, block_k=64):
    """dout (B, T, C) -> dqkv (B, T, 3C), from the forward's out (B, T, C) and lse (B, NH, T).

    The gradients of attention_backward, tile by tile, with P = exp(S * scale - lse) recomputed per tile
    (S = q k^T) instead of read from a saved att:
        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = dS K * scale,   dK = dS^T Q * scale
    where D_i = sum_j P_ij dP_ij is the softmax backward's row term. That sum runs over the whole row, which one
    tile does not hold. But it does not need P at all:
        D_i = sum_j P_ij dP_ij = sum_j P_ij sum_c dO_ic V_jc = sum_c dO_ic sum_j P_ij V_jc = sum_c dO_ic O_ic
    because O = P V. So D = rowsum(dO * O), a (B, NH, T) pre-pass over hs channels before the tiles.

    As in FlashAttention-2 the outer loop runs over key/value tiles, so each tile's dK and dV are summed in
    place over the query tiles that see it (those whose last row reaches j0); dQ is added to from every key tile
    (on a GPU, where key tiles run in parallel, with atomic adds)."""
    q, k, v = split_heads(qkv, NH)                                      # each (B, NH, T, hs)
    B, _, T, hs = q.shape
    scale = 1 / math.sqrt(hs)
    dout = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)            # (B, NH, T, hs)
    out = out.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)              # (B, NH, T, hs)
    D = (dout * out).sum(axis=-1)                                       # (B, NH, T)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j0 in range(0, T, block_k):                                    # one key/value tile: columns j0 <= j < j1
        j1 = min(j0 + block_k, T)
        for i0 in range(j0 // block_q * block_q, T, block_q):          # query tiles from the one holding row j0
            i1 = min(i0 + block_q, T)
            s = causal_scores(q, k, i0, i1, j0, j1, scale)              # (B, NH, bq, bk)
            p = np.exp(s - lse[:, :, i0:i1, None])                     # the forward's probabilities, exactly
            do = dout[:, :, i0:i1]                                      # (B, NH, bq, hs)
            dv[:, :, j0:j1] += p.swapaxes(-1, -2) @ do                 # (B, NH, bk, hs)
            dp = do @ v[:, :, j0:j1].swapaxes(-1, -2)                  # (B, NH, bq, bk)
            ds = p * (dp - D[:, :, i0:i1, None])                       # masked entries have p = 0, so ds = 0
            dq[:, :, i0:i1] += ds @ k[:, :, j0:j1] * scale            # (B, NH, bq, hs)
            dk[:, :, j0:j1] += ds.swapaxes(-1, -2) @ q[:, :, i0:i1] * scale   # (B, NH, bk, hs)
    return np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)
