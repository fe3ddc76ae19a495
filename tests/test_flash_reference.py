"""The blocked FlashAttention-2 reference computes the naive attention of reference/attention.py, in float64.

Sizes are picked so the tiles do not line up: T not a multiple of the tile sizes, a single position, query and
key tiles of different sizes, and tiles larger than T.
"""
import numpy as np
import pytest

import reference as ref
from test_reference import assert_gradient

# (B, T, NH, hs, BQ, BK)
SIZES = [
    (2, 37, 2, 16, 16, 16),    # 37 = 2 * 16 + 5: a ragged last tile in both loops
    (1, 1, 2, 32, 16, 16),     # one position: one row, one key, p = 1
    (2, 37, 3, 32, 16, 8),     # BQ > BK: key tiles wholly above some rows of a query tile
    (2, 50, 2, 64, 8, 32),     # BQ < BK: a key tile crosses several query tiles' diagonals
    (3, 20, 2, 16, 64, 64),    # one tile holds everything: the naive algorithm
    (1, 64, 4, 64, 16, 16),    # GPT-2's hs, T a multiple of the tiles
]
ATOL = 1e-12


def inputs(B, T, NH, hs, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, T, 3 * NH * hs)), rng.standard_normal((B, T, NH * hs))   # qkv, dout


def masked_scores(qkv, NH):
    """The naive scores q k^T / sqrt(hs), (B, NH, T, T), with -inf above the diagonal."""
    q, k, _ = ref.attention.split_heads(qkv, NH)
    T, hs = q.shape[-2:]
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(hs)                           # (B, NH, T, T)
    return np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)


@pytest.mark.parametrize("B, T, NH, hs, BQ, BK", SIZES)
def test_flash_forward_equals_naive_attention(B, T, NH, hs, BQ, BK):
    qkv, _ = inputs(B, T, NH, hs)
    out, lse = ref.flash_forward(qkv, NH, BQ=BQ, BK=BK)
    expected, _ = ref.attention_forward(qkv, NH)
    assert out.shape == (B, T, NH * hs) and lse.shape == (B, NH, T)
    np.testing.assert_allclose(out, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("B, T, NH, hs, BQ, BK", SIZES)
def test_flash_lse_is_the_log_sum_exp_of_the_masked_scores(B, T, NH, hs, BQ, BK):
    qkv, _ = inputs(B, T, NH, hs)
    _, lse = ref.flash_forward(qkv, NH, BQ=BQ, BK=BK)
    scores = masked_scores(qkv, NH)
    np.testing.assert_allclose(lse, np.logaddexp.reduce(scores, axis=-1), rtol=0, atol=ATOL)
    # and exp(scores - lse) gives back the naive probabilities, zeros above the diagonal included
    _, att = ref.attention_forward(qkv, NH)
    np.testing.assert_allclose(np.exp(scores - lse[..., None]), att, rtol=0, atol=ATOL)


@pytest.mark.parametrize("B, T, NH, hs, BQ, BK", SIZES)
def test_flash_backward_equals_naive_attention_backward(B, T, NH, hs, BQ, BK):
    qkv, dout = inputs(B, T, NH, hs)
    out, lse = ref.flash_forward(qkv, NH, BQ=BQ, BK=BK)
    dqkv = ref.flash_backward(dout, qkv, out, lse, NH, BQ=BQ, BK=BK)
    _, att = ref.attention_forward(qkv, NH)
    expected = ref.attention_backward(dout, qkv, att, NH)
    assert dqkv.shape == qkv.shape
    np.testing.assert_allclose(dqkv, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("T", [1, 37, 129])
@pytest.mark.parametrize("hs", [16, 32, 64])
def test_two_pass_backward_and_lse_at_the_kernels_tiles_equal_naive_attention(T, hs):
    # BQ = BK = 64 as in flash_attention.cu; 37 is less than one tile, 129 = 2 * 64 + 1 a one-row last tile
    B, NH = 2, 2
    qkv, dout = inputs(B, T, NH, hs)
    out, lse = ref.flash_forward(qkv, NH)
    expected_out, att = ref.attention_forward(qkv, NH)
    np.testing.assert_allclose(out, expected_out, rtol=0, atol=ATOL)
    np.testing.assert_allclose(lse, np.logaddexp.reduce(masked_scores(qkv, NH), axis=-1), rtol=0, atol=ATOL)
    # the dK/dV pass and the dQ pass, each against its third of the naive backward
    expected = ref.attention_backward(dout, qkv, att, NH)
    D = ref.flash_backward_dot(dout, out, NH)
    dk, dv = ref.flash_backward_dkv(dout, qkv, lse, D, NH)
    dq = ref.flash_backward_dq(dout, qkv, lse, D, NH)
    C = NH * hs
    np.testing.assert_allclose(ref.attention.merge_heads(dq), expected[..., :C], rtol=0, atol=ATOL)
    np.testing.assert_allclose(ref.attention.merge_heads(dk), expected[..., C:2 * C], rtol=0, atol=ATOL)
    np.testing.assert_allclose(ref.attention.merge_heads(dv), expected[..., 2 * C:], rtol=0, atol=ATOL)
    # D = rowsum(dO * O) is the softmax backward's sum_j P_ij dP_ij, without P
    v = ref.attention.split_heads(qkv, NH)[2]
    dP = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3) @ v.swapaxes(-1, -2)      # (B, NH, T, T)
    np.testing.assert_allclose(D, (att * dP).sum(axis=-1), rtol=0, atol=ATOL)


def test_flash_backward_matches_finite_differences():
    B, T, NH, hs = 2, 7, 2, 3
    qkv, R = inputs(B, T, NH, hs, seed=1234)
    tiles = dict(BQ=3, BK=2)                            # 7 = 3 + 3 + 1 rows, 2 + 2 + 2 + 1 keys
    out, lse = ref.flash_forward(qkv, NH, **tiles)
    dqkv = ref.flash_backward(R, qkv, out, lse, NH, **tiles)
    # Position 0 attends to itself alone, with p = 1 whatever its score, so its q has no gradient. The naive
    # backward gets 0 exactly; here dS = P (dP - D) subtracts two sums of dO v_0 taken in different orders
    # (a matmul, and the rowsum dO * O), which leaves rounding of ~1e-16: no relative error to speak of.
    C = NH * hs
    assert np.abs(dqkv[:, 0, :C]).max() < 1e-14
    rest = [i for i in np.ndindex(qkv.shape) if not (i[1] == 0 and i[2] < C)]
    assert_gradient(lambda: ref.flash_forward(qkv, NH, **tiles)[0], R, qkv, dqkv, rest)


def test_flash_attention_stays_in_float32_and_raises_no_floating_point_error():
    qkv, dout = (a.astype(np.float32) for a in inputs(2, 37, 2, 16))
    with np.errstate(divide="raise", over="raise", invalid="raise"):   # exp(-inf - m) = 0 is no error
        out, lse = ref.flash_forward(qkv, 2, BQ=16, BK=8)
        dqkv = ref.flash_backward(dout, qkv, out, lse, 2, BQ=16, BK=8)
    assert out.dtype == lse.dtype == dqkv.dtype == np.float32
    expected, _ = ref.attention_forward(qkv.astype(np.float64), 2)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)


def test_flash_attention_is_causal_future_positions_change_no_earlier_output():
    qkv, dout = inputs(2, 37, 2, 16)
    s = 21                                                              # inside the second 16-row tile
    future = qkv.copy()
    future[:, s:] += 1.0
    out, _ = ref.flash_forward(qkv, 2, BQ=16, BK=16)
    out2, _ = ref.flash_forward(future, 2, BQ=16, BK=16)
    assert np.array_equal(out2[:, :s], out[:, :s])                      # bit for bit: masked p is exactly 0
    dout[:, s:] = 0                                                     # a gradient only at positions < s
    out, lse = ref.flash_forward(qkv, 2, BQ=16, BK=16)
    dqkv = ref.flash_backward(dout, qkv, out, lse, 2, BQ=16, BK=16)
    assert np.all(dqkv[:, s:] == 0) and np.abs(dqkv[:, :s]).max() > 0
