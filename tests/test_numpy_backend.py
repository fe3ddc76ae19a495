"""The NumPy backend's ops equal reference/'s functions, placed as llm/backends/__init__.py says.

Forward ops write their outputs, backward ops overwrite dinp/dqkv and accumulate into parameter gradients,
layernorm_backward accumulates into dinp too. Buffers that must be overwritten start as NaN, so an op that
added into them instead would leave NaN behind; buffers that must accumulate start at random values.
"""
import numpy as np
import pytest

import reference as ref
from llm.backends import get_backend, numpy_backend

B, T, C, NH, maxT = 2, 5, 8, 2, 7


@pytest.fixture(scope="module")
def be():
    return get_backend("numpy")


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def nans(*shape):
    return np.full(shape, np.nan, np.float32)


def test_numpy_backend_is_float32_only():
    assert get_backend("numpy").dtype == np.float32
    with pytest.raises(ValueError, match="the numpy backend computes in fp32, not .bf16."):
        get_backend("numpy", precision="bf16")


def test_encoder_forward_writes_wte_rows_plus_wpe(be, rng):
    inp = np.array([[3, 1, 3, 0, 2], [1, 1, 4, 2, 0]], np.int32)
    wte, wpe = randn(rng, 6, C), randn(rng, maxT, C)
    out = nans(B, T, C)
    be.encoder_forward(out, inp, wte, wpe)
    np.testing.assert_array_equal(out, ref.encoder_forward(inp, wte, wpe))
    np.testing.assert_array_equal(out[1, 2], wte[4] + wpe[2])


def test_encoder_backward_accumulates_into_dwte_and_dwpe_with_repeated_tokens(be, rng):
    inp = np.array([[3, 1, 3, 0, 2], [1, 1, 4, 2, 0]], np.int32)     # 1 three times, 3 twice
    dout, dwte0, dwpe0 = randn(rng, B, T, C), randn(rng, 6, C), randn(rng, maxT, C)
    dwte_ref, dwpe_ref = ref.encoder_backward(dout, inp, (6, C), (maxT, C))
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    be.encoder_backward(dwte, dwpe, dout, inp)
    np.testing.assert_array_equal(dwte, dwte0 + dwte_ref)
    np.testing.assert_array_equal(dwpe, dwpe0 + dwpe_ref)
    be.encoder_backward(dwte, dwpe, dout, inp)
    np.testing.assert_array_equal(dwte, dwte0 + dwte_ref + dwte_ref)
    np.testing.assert_array_equal(dwpe, dwpe0 + dwpe_ref + dwpe_ref)
    np.testing.assert_allclose(dwte_ref[1], dout[0, 1] + dout[1, 0] + dout[1, 1], rtol=1e-6)


def test_layernorm_forward_writes_out_mean_and_rstd(be, rng):
    x, w, b = randn(rng, B, T, C), randn(rng, C), randn(rng, C)
    out, mean, rstd = nans(B, T, C), nans(B, T), nans(B, T)
    be.layernorm_forward(out, mean, rstd, x, w, b)
    for got, want in zip((out, mean, rstd), ref.layernorm_forward(x, w, b)):
        np.testing.assert_array_equal(got, want)


def test_layernorm_backward_accumulates_into_dinp_dw_and_db(be, rng):
    x, w, b, dout = randn(rng, B, T, C), randn(rng, C), randn(rng, C), randn(rng, B, T, C)
    _, mean, rstd = ref.layernorm_forward(x, w, b)
    dx_ref, dw_ref, db_ref = ref.layernorm_backward(dout, x, w, mean, rstd)
    starts = randn(rng, B, T, C), randn(rng, C), randn(rng, C)   # dinp already holds the skip path's share
    dinp, dw, db = (a.copy() for a in starts)
    be.layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd)
    for got, start, r in zip((dinp, dw, db), starts, (dx_ref, dw_ref, db_ref)):
        np.testing.assert_array_equal(got, start + r)
    be.layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd)
    for got, start, r in zip((dinp, dw, db), starts, (dx_ref, dw_ref, db_ref)):
        np.testing.assert_array_equal(got, start + r + r)
    dbias0 = randn(rng, C)   # the projection below's bias gradient: += the column sums of dinp as updated
    dbias = dbias0.copy()
    be.layernorm_backward(dinp, dw, db, dout, x, w, mean, rstd, dbias)
    updated = starts[0] + dx_ref + dx_ref + dx_ref
    np.testing.assert_array_equal(dinp, updated)
    np.testing.assert_array_equal(dbias, dbias0 + updated.reshape(-1, C).sum(axis=0))


@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_forward_writes_inp_times_w_transposed_plus_bias(be, rng, has_bias):
    x, w = randn(rng, B, T, C), randn(rng, 3 * C, C)
    bias = randn(rng, 3 * C) if has_bias else None
    out = nans(B, T, 3 * C)
    be.matmul_forward(out, x, w, bias)
    np.testing.assert_array_equal(out, ref.matmul_forward(x, w, bias))
    np.testing.assert_allclose(out[0, 0], w @ x[0, 0] + (bias if has_bias else 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_backward_overwrites_dinp_and_accumulates_dw_and_dbias(be, rng, has_bias):
    x, w, dout = randn(rng, B, T, C), randn(rng, 3 * C, C), randn(rng, B, T, 3 * C)
    dx_ref, dw_ref, dbias_ref = ref.matmul_backward(dout, x, w, has_bias)
    dw0, dbias0 = randn(rng, 3 * C, C), randn(rng, 3 * C)
    dinp, dw = nans(B, T, C), dw0.copy()
    dbias = dbias0.copy() if has_bias else None
    for calls in (1, 2):                                   # a second call doubles dw, dbias, not dinp
        be.matmul_backward(dinp, dw, dbias, dout, x, w)
        np.testing.assert_array_equal(dinp, dx_ref)
        np.testing.assert_allclose(dw, dw0 + calls * dw_ref, rtol=1e-6, atol=1e-6)
        if has_bias:
            np.testing.assert_allclose(dbias, dbias0 + calls * dbias_ref, rtol=1e-6, atol=1e-6)


def test_matmul_gelu_forward_and_backward_equal_the_matmul_then_gelu(be, rng):
    x, w, bias = randn(rng, B, T, C), randn(rng, 4 * C, C), randn(rng, 4 * C)
    out, gelu_out = nans(B, T, 4 * C), nans(B, T, 4 * C)
    be.matmul_gelu_forward(out, gelu_out, x, w, bias)
    np.testing.assert_array_equal(out, ref.matmul_forward(x, w, bias))
    np.testing.assert_array_equal(gelu_out, ref.gelu_forward(out))
    w2, dout, dw0, db0 = randn(rng, C, 4 * C), randn(rng, B, T, C), randn(rng, C, 4 * C), randn(rng, C)
    dgelu, dw_ref, db_ref = ref.matmul_backward(dout, gelu_out, w2, has_bias=True)
    dfch = ref.gelu_backward(dgelu, out)
    for recompute in (False, True):   # recompute writes gelu_out again before using it
        dinp, dw, db, dbias_prev0 = nans(B, T, 4 * C), dw0.copy(), db0.copy(), randn(rng, 4 * C)
        dbias_prev, given = dbias_prev0.copy(), nans(B, T, 4 * C) if recompute else gelu_out
        be.matmul_gelu_backward(dinp, dw, db, dout, given, w2, out, dbias_prev, recompute)
        np.testing.assert_array_equal(given, gelu_out)
        np.testing.assert_array_equal(dinp, dfch)
        np.testing.assert_array_equal(dw, dw0 + dw_ref)
        np.testing.assert_array_equal(db, db0 + db_ref)
        np.testing.assert_array_equal(dbias_prev, dbias_prev0 + dfch.reshape(-1, 4 * C).sum(axis=0))


def test_attention_forward_writes_out_and_keeps_the_probabilities(be, rng):
    qkv = randn(rng, B, T, 3 * C)
    shape, dtype = be.attention_saved_shape(B, T, NH)
    assert shape == (B, NH, T, T) and dtype == np.float32
    out, att = nans(B, T, C), nans(*shape)
    be.attention_forward(out, att, qkv, NH)
    out_ref, att_ref = ref.attention_forward(qkv, NH)
    np.testing.assert_array_equal(out, out_ref)
    np.testing.assert_array_equal(att, att_ref)


def test_attention_backward_overwrites_dqkv_and_accumulates_the_qkv_bias_gradient(be, rng):
    qkv, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    _, att = ref.attention_forward(qkv, NH)
    dqkv, dbias = nans(B, T, 3 * C), randn(rng, 3 * C)
    expected_dbias = dbias.copy()
    for _ in range(2):
        be.attention_backward(dqkv, dbias, dout, qkv, ref.attention_forward(qkv, NH)[0], att, NH)
        np.testing.assert_array_equal(dqkv, ref.attention_backward(dout, qkv, att, NH))
        expected_dbias += dqkv.reshape(-1, 3 * C).sum(axis=0)   # as reference/matmul.py sums a bias
        np.testing.assert_array_equal(dbias, expected_dbias)


def test_gelu_forward_writes(be, rng):
    x = randn(rng, B, T, 4 * C)
    out = nans(B, T, 4 * C)
    be.gelu_forward(out, x)
    np.testing.assert_array_equal(out, ref.gelu_forward(x))


# ---- the classifier: 3 x 11 = 33 positions, so slices of CLASSIFIER_ROWS = 16 leave a remainder ----
CB, CT, V, Vp = 3, 11, 13, 16


def classifier_inputs(rng):
    logits = randn(rng, CB, CT, Vp)
    logits[..., V:] = 30.0             # large padded logits, to show they are not part of the softmax
    return logits, rng.integers(0, V, (CB, CT)).astype(np.int32)


def test_fused_classifier_writes_losses_and_overwrites_logits_by_dlogits(be, rng):
    assert CB * CT > 2 * numpy_backend.CLASSIFIER_ROWS
    logits, targets = classifier_inputs(rng)
    dloss = 1 / (CB * CT)                                  # the mean's share, as the model passes it
    losses_ref, probs = ref.crossentropy_forward(logits, targets, V)
    dlogits_ref = ref.crossentropy_backward(probs, targets, np.full((CB, CT), dloss, np.float32))
    losses = nans(CB, CT)
    be.fused_classifier(logits, losses, targets, V, dloss)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-6)
    np.testing.assert_allclose(logits, dlogits_ref, rtol=1e-6, atol=1e-9)
    assert np.all(logits[..., V:] == 0)                    # padding: probability 0, gradient 0
    np.testing.assert_allclose(logits.sum(axis=-1), 0, atol=1e-7)   # sum(probs) - 1 = 0, times dloss


def test_fused_classifier_without_dloss_leaves_logits_untouched(be, rng):
    logits, targets = classifier_inputs(rng)
    before = logits.copy()
    losses = nans(CB, CT)
    be.fused_classifier(logits, losses, targets, V, None)
    np.testing.assert_array_equal(logits, before)
    np.testing.assert_allclose(losses, ref.crossentropy_forward(before, targets, V)[0], rtol=1e-6)


# ---- optimizer and norm ----

def test_adamw_in_chunks_over_a_segment_equals_one_reference_update(be, rng, monkeypatch):
    monkeypatch.setattr(numpy_backend, "ADAMW_CHUNK", 64)
    lo, hi = 100, 1100                                     # 1000 elements: 15 full chunks and a partial one
    flat_param, flat_grad = randn(rng, 1200), randn(rng, 1200)
    flat_m, flat_v = 0.1 * randn(rng, 1200), (0.1 * randn(rng, 1200)) ** 2
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    want_p, want_m, want_v = ref.adamw_update(flat_param[lo:hi], flat_grad[lo:hi], flat_m[lo:hi],
                                              flat_v[lo:hi], t=3, grad_scale=np.float32(0.8), **hyper)
    before = [a.copy() for a in (flat_param, flat_grad, flat_m, flat_v)]
    be.adamw(flat_param[lo:hi], flat_grad[lo:hi], flat_m[lo:hi], flat_v[lo:hi], None, t=3,
             grad_scale=np.array(0.8, np.float32), **hyper)
    for got, want in zip((flat_param, flat_m, flat_v), (want_p, want_m, want_v)):
        np.testing.assert_array_equal(got[lo:hi], want)     # element-wise: slicing changes no bit
    np.testing.assert_array_equal(flat_grad, before[1])    # the gradient is read only
    for got, old in zip((flat_param, flat_m, flat_v), (before[0], before[2], before[3])):
        np.testing.assert_array_equal(got[:lo], old[:lo])  # nothing outside the segment moves
        np.testing.assert_array_equal(got[hi:], old[hi:])
    assert np.all(flat_param[lo:hi] != before[0][lo:hi])


def test_adamw_with_a_nan_grad_scale_changes_nothing(be, rng):
    """NaN is clip_scale's answer for a step with a non-finite loss or norm."""
    param, grad, m, v = randn(rng, 300), randn(rng, 300), 0.1 * randn(rng, 300), (0.1 * randn(rng, 300)) ** 2
    before = [a.copy() for a in (param, m, v)]
    be.adamw(param, grad, m, v, None, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, np.array(np.nan, np.float32))
    for got, old in zip((param, m, v), before):
        np.testing.assert_array_equal(got, old)


def test_fetch_gives_the_values_of_the_moment_it_was_called(be):
    x = np.array([1.5, 2.5], np.float32)
    fetched = be.fetch(x)
    x[...] = 7.0   # later work may change x: the fetch keeps what x held
    assert fetched().tolist() == [1.5, 2.5]


def test_sumsq_is_the_sum_of_squares_as_a_float32_scalar(be, rng):
    x = randn(rng, 1000)
    s = be.sumsq(x)
    assert s.shape == () and s.dtype == np.float32
    assert float(s) == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-5)
    assert float(be.sumsq(np.array([3.0, 4.0], np.float32))) == 25.0
