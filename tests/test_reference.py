"""The hand-derived backward passes agree with central finite differences, in float64.

For a layer, the scalar L = sum(out * R) with a fixed random R has the analytic gradient backward(dout=R),
and each input entry's numerical gradient is (L(x + eps) - L(x - eps)) / (2 eps). The whole reference
GPT-2 is checked the same way against its mean loss.
"""
import numpy as np
import pytest

import reference as ref
from llm.config import GPT2Config
from llm.layout import PARAM_NAMES, param_shapes
from reference.gpt2 import adamw_step, gpt2_backward, gpt2_forward

EPS = 1e-6        # central-difference step
TOL = 1e-6        # max relative error


def rel_error(a, n):
    return np.abs(a - n) / np.maximum(np.abs(a) + np.abs(n), 1e-12)


def numerical_grad(forward, R, x, index):
    """d sum(forward() * R) / d x[index] by central differences; x is perturbed in place and restored.

    L(x + eps) - L(x - eps) is summed as sum((out(x + eps) - out(x - eps)) * R): the same difference, but
    without first rounding two large sums (which would cost every entry ~1e-16 |L| / eps, about 1e-9 here)."""
    orig = x[index]
    x[index] = orig + EPS
    up = forward()
    x[index] = orig - EPS
    down = forward()
    x[index] = orig
    return float(np.sum((up - down) * R)) / (2 * EPS)


def assert_gradient(forward, R, x, analytic, indices=None):
    """Max relative error between analytic[i] and the numerical gradient over indices (all by default)."""
    assert analytic.shape == x.shape
    indices = list(np.ndindex(x.shape)) if indices is None else indices
    numeric = np.array([numerical_grad(forward, R, x, i) for i in indices])
    err = rel_error(np.array([analytic[i] for i in indices]), numeric).max()
    assert err < TOL, f"max relative error {err:.2e} over {len(indices)} entries"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---- one layer at a time ----

def test_encoder_backward_matches_finite_differences_with_a_repeated_token(rng):
    inp = np.array([[1, 3, 1, 0], [3, 5, 1, 2]])          # token 1 three times, token 3 twice
    wte, wpe = rng.standard_normal((7, 3)), rng.standard_normal((6, 3))   # Vp = 7, maxT = 6, C = 3
    R = rng.standard_normal((2, 4, 3))
    dwte, dwpe = ref.encoder_backward(R, inp, wte.shape, wpe.shape)
    forward = lambda: ref.encoder_forward(inp, wte, wpe)
    assert_gradient(forward, R, wte, dwte)
    assert_gradient(forward, R, wpe, dwpe)
    np.testing.assert_allclose(dwte[1], R[0, 0] + R[0, 2] + R[1, 2])   # every occurrence adds up
    assert np.all(dwte[[4, 6]] == 0) and np.all(dwpe[4:] == 0)        # unused tokens, positions >= T


@pytest.mark.parametrize("wrt", ["x", "w", "b"])
def test_layernorm_backward_matches_finite_differences(rng, wrt):
    x = 0.5 + 2 * rng.standard_normal((2, 3, 5))           # off-centre and wide, so mean and rstd matter
    w, b = 1 + 0.1 * rng.standard_normal(5), 0.1 * rng.standard_normal(5)
    R = rng.standard_normal((2, 3, 5))
    out, mean, rstd = ref.layernorm_forward(x, w, b)
    grads = dict(zip("xwb", ref.layernorm_backward(R, x, w, mean, rstd)))
    forward = lambda: ref.layernorm_forward(x, w, b)[0]
    assert_gradient(forward, R, dict(x=x, w=w, b=b)[wrt], grads[wrt])


def test_layernorm_forward_normalizes_with_biased_variance(rng):
    x = 3 + 2 * rng.standard_normal((4, 8))
    out, mean, rstd = ref.layernorm_forward(x, np.ones(8), np.zeros(8))
    np.testing.assert_allclose(out.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose((out ** 2).mean(axis=-1), x.var(axis=-1) / (x.var(axis=-1) + 1e-5))
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(axis=-1) + 1e-5))


@pytest.mark.parametrize("has_bias", [True, False])
def test_matmul_backward_matches_finite_differences(rng, has_bias):
    x, w = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4))   # C = 4, OC = 5
    bias = rng.standard_normal(5) if has_bias else None
    R = rng.standard_normal((2, 3, 5))
    dx, dw, dbias = ref.matmul_backward(R, x, w, has_bias)
    forward = lambda: ref.matmul_forward(x, w, bias)
    assert_gradient(forward, R, x, dx)
    assert_gradient(forward, R, w, dw)
    if has_bias:
        assert_gradient(forward, R, bias, dbias)
    else:
        assert dbias is None


def test_attention_backward_matches_finite_differences(rng):
    B, T, NH, hs = 2, 5, 2, 3
    qkv, R = rng.standard_normal((B, T, 3 * NH * hs)), rng.standard_normal((B, T, NH * hs))
    out, att = ref.attention_forward(qkv, NH)
    dqkv = ref.attention_backward(R, qkv, att, NH)
    assert_gradient(lambda: ref.attention_forward(qkv, NH)[0], R, qkv, dqkv)


def test_attention_is_causal_future_positions_change_no_earlier_output(rng):
    B, T, NH, hs, s = 2, 6, 2, 4, 3
    qkv = rng.standard_normal((B, T, 3 * NH * hs))
    out, att = ref.attention_forward(qkv, NH)
    future = qkv.copy()
    future[:, s:] += rng.standard_normal((B, T - s, 3 * NH * hs))   # new q, k and v from position s on
    out2, _ = ref.attention_forward(future, NH)
    assert np.array_equal(out2[:, :s], out[:, :s])                    # bit for bit: masked att is exactly 0
    assert np.abs(out2[:, s:] - out[:, s:]).min() > 0
    assert np.all(np.triu(att, k=1) == 0)                             # no weight on t2 > t
    np.testing.assert_allclose(att.sum(axis=-1), 1)
    # and backward: a gradient only at positions < s reaches no q, k or v at positions >= s
    dout = np.zeros((B, T, NH * hs))
    dout[:, :s] = rng.standard_normal((B, s, NH * hs))
    dqkv = ref.attention_backward(dout, qkv, att, NH)
    assert np.all(dqkv[:, s:] == 0) and np.abs(dqkv[:, :s]).max() > 0


def test_gelu_backward_matches_finite_differences(rng):
    x = np.linspace(-3, 3, 21).reshape(3, 7)   # misses gelu's minimum near -0.75, where dy/dx = 0
    R = rng.standard_normal((3, 7))
    assert_gradient(lambda: ref.gelu_forward(x), R, x, ref.gelu_backward(R, x))


def test_gelu_forward_is_the_tanh_approximation():
    x = np.array([-3.0, -1.0, 0.0, 1.0, 3.0])
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), worked out to 9 digits
    expected = [-0.00363739208, -0.158808009, 0.0, 0.841191991, 2.99636261]
    np.testing.assert_allclose(ref.gelu_forward(x), expected, rtol=1e-8, atol=1e-12)


def test_residual_backward_matches_finite_differences(rng):
    a, b, R = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    da, db = ref.residual_backward(R)
    forward = lambda: ref.residual_forward(a, b)
    assert_gradient(forward, R, a, da)
    assert_gradient(forward, R, b, db)


def test_crossentropy_backward_matches_finite_differences_and_padding_gets_nothing(rng):
    B, T, V, Vp = 2, 3, 5, 8
    logits = rng.standard_normal((B, T, Vp))
    logits[..., V:] = 50.0                    # huge padded logits: they must still be ignored
    targets = rng.integers(0, V, (B, T))
    R = rng.standard_normal((B, T))           # the weight of each position's loss
    losses, probs = ref.crossentropy_forward(logits, targets, V)
    dlogits = ref.crossentropy_backward(probs, targets, R)
    forward = lambda: ref.crossentropy_forward(logits, targets, V)[0]
    assert_gradient(forward, R, logits, dlogits)
    assert np.all(probs[..., V:] == 0) and np.all(dlogits[..., V:] == 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1)
    z = logits[..., :V]
    expected = np.log(np.exp(z).sum(axis=-1)) - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(losses, expected)


# ---- the whole model ----

TINY = GPT2Config(max_seq_len=16, vocab_size=37, padded_vocab_size=48, num_layers=2, num_heads=2, channels=16)
B, T = 2, 8
SAMPLES = 6               # entries checked per tensor
MIN_GRAD = 1e-3           # entries with smaller gradients are not sampled (see gradient_indices)


def random_params(config, rng, dtype=np.float64):
    """std 0.1 everywhere, except layernorm weights near 1."""
    params = {}
    for name, shape in param_shapes(config).items():
        is_ln_weight = name in ("ln1w", "ln2w", "lnfw")
        params[name] = ((1.0 if is_ln_weight else 0.0) + 0.1 * rng.standard_normal(shape)).astype(dtype)
    return params


def tiny_batch(rng):
    return rng.integers(0, TINY.vocab_size, (B, T)), rng.integers(0, TINY.vocab_size, (B, T))


def gradient_indices(grad, rng, allowed, n=SAMPLES):
    """n random entries of grad where allowed (a boolean mask of grad's shape) and |grad| >= MIN_GRAD.

    The mean loss is one rounded scalar (~1e-15 off), so its central difference is off by ~1e-9 whatever
    the gradient; an entry with a gradient below 1e-3 would measure that rounding, not the derivation."""
    candidates = np.argwhere(allowed & (np.abs(grad) >= MIN_GRAD))
    assert len(candidates) >= n, f"only {len(candidates)} entries with |grad| >= {MIN_GRAD}"
    return [tuple(i) for i in candidates[rng.choice(len(candidates), n, replace=False)]]


@pytest.fixture(scope="module")
def tiny_model():
    rng = np.random.default_rng(0)
    params = random_params(TINY, rng)
    inp, targets = tiny_batch(rng)
    _, _, cache = gpt2_forward(params, TINY, inp, targets)
    return params, inp, targets, gpt2_backward(params, TINY, cache)


@pytest.mark.parametrize("name", PARAM_NAMES)
def test_gpt2_backward_matches_finite_differences_of_the_mean_loss(tiny_model, name):
    params, inp, targets, grads = tiny_model
    rng = np.random.default_rng(PARAM_NAMES.index(name))
    grad = grads[name]
    assert grad.shape == params[name].shape
    everywhere = np.ones(grad.shape, dtype=bool)
    if name == "wte":
        # rows of tokens in inp get the embedding's gradient and the lm_head's; other rows only the lm_head's
        in_inp = np.isin(np.arange(TINY.padded_vocab_size), inp)[:, None] & everywhere
        head_only = (np.arange(TINY.padded_vocab_size) < TINY.vocab_size)[:, None] & ~in_inp
        indices = gradient_indices(grad, rng, in_inp, 3) + gradient_indices(grad, rng, head_only, 3)
    elif name == "wpe":
        indices = gradient_indices(grad, rng, (np.arange(TINY.max_seq_len) < T)[:, None] & everywhere)
    else:
        indices = gradient_indices(grad, rng, everywhere)
    mean_loss = lambda: gpt2_forward(params, TINY, inp, targets)[1]
    assert_gradient(mean_loss, 1.0, params[name], grad, indices)


def test_gpt2_backward_gives_padded_vocab_rows_and_unused_positions_exactly_zero(tiny_model):
    params, inp, targets, grads = tiny_model
    assert np.all(grads["wte"][TINY.vocab_size:] == 0)     # rows 37..47: logits that no softmax sees
    assert np.all(grads["wpe"][T:] == 0)                   # positions 8..15: not in a T = 8 batch
    assert np.abs(grads["wte"][:TINY.vocab_size]).min() > 0


def test_gpt2_key_bias_gets_no_gradient_because_softmax_ignores_a_shift(tiny_model):
    # k + b_k adds q . b_k to every score of a row, and softmax is unchanged by adding a constant
    params, inp, targets, grads = tiny_model
    C = TINY.channels
    assert np.abs(grads["qkvb"][:, C:2 * C]).max() < 1e-15
    assert np.abs(grads["qkvb"][:, :C]).max() > 1e-3 and np.abs(grads["qkvb"][:, 2 * C:]).max() > 1e-3


def test_gpt2_loss_at_uniform_logits_is_log_V():
    params = {name: np.zeros(shape) for name, shape in param_shapes(TINY).items()}
    inp, targets = tiny_batch(np.random.default_rng(0))
    _, loss, _ = gpt2_forward(params, TINY, inp, targets)
    assert loss == pytest.approx(np.log(TINY.vocab_size), abs=1e-12)


def test_gpt2_backward_without_targets_is_an_error(tiny_model):
    params, inp, _, _ = tiny_model
    logits, loss, cache = gpt2_forward(params, TINY, inp)
    assert loss is None and logits.shape == (B, T, TINY.padded_vocab_size)
    with pytest.raises(ValueError, match="targets"):
        gpt2_backward(params, TINY, cache)


# ---- AdamW ----

def test_adamw_update_matches_a_hand_computed_element_at_steps_1_and_2():
    lr, beta1, beta2, eps, wd, scale = 0.1, 0.9, 0.95, 1e-8, 0.1, 0.5
    one = lambda x: np.array([x])
    # t = 1: g = 0.5 * 0.5 = 0.25; m = 0.1 * 0.25 = 0.025; v = 0.05 * 0.0625 = 0.003125
    #        mhat = 0.025 / 0.1 = 0.25; vhat = 0.003125 / 0.05 = 0.0625, sqrt = 0.25
    #        param = 1 - 0.1 * (0.25 / (0.25 + 1e-8) + 0.1 * 1) = 0.890000004 (0.25/0.25 is 1 less 4e-8)
    p, m, v = ref.adamw_update(one(1.0), one(0.5), one(0.0), one(0.0), 1, lr, beta1, beta2, eps, wd, scale)
    np.testing.assert_allclose(m, [0.025], rtol=1e-15)
    np.testing.assert_allclose(v, [0.003125], rtol=1e-15)
    np.testing.assert_allclose(p, [0.89000000399999984], rtol=1e-15)
    # t = 2: g = 0.5 * -1 = -0.5; m = 0.9 * 0.025 - 0.05 = -0.0275
    #        v = 0.95 * 0.003125 + 0.05 * 0.25 = 0.01546875
    #        mhat = -0.0275 / 0.19 = -0.144736842...
    #        vhat = 0.01546875 / 0.0975 = 0.158653846..., sqrt = 0.398313...
    #        param = 0.890000004 - 0.1 * (-0.144736842 / 0.398313753 + 0.1 * 0.890000004) = 0.917437398
    p, m, v = ref.adamw_update(p, one(-1.0), m, v, 2, lr, beta1, beta2, eps, wd, scale)
    np.testing.assert_allclose(m, [-0.0275], rtol=1e-14)
    np.testing.assert_allclose(v, [0.01546875], rtol=1e-14)
    np.testing.assert_allclose(p, [0.91743739809545246], rtol=1e-14)


def test_adamw_step_decays_only_the_matrices():
    shapes = param_shapes(TINY)
    params = {name: np.ones(shape) for name, shape in shapes.items()}
    zeros = {name: np.zeros(shape) for name, shape in shapes.items()}
    new, _, _ = adamw_step(params, zeros, zeros, zeros, 1, lr=0.1, weight_decay=0.5)
    # a zero gradient leaves only the decay: 1 - lr * wd * 1 = 0.95 for matrices, unchanged otherwise
    decayed = {name for name in PARAM_NAMES if np.all(new[name] == 0.95)}
    assert decayed == {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
    assert all(np.all(new[name] == 1.0) for name in PARAM_NAMES if name not in decayed)


# ---- float32 ----

def test_every_layer_keeps_float32_in_float32(rng):
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    inp, targets = np.array([[1, 2, 1], [0, 3, 2]]), np.array([[2, 0, 1], [3, 3, 0]])
    x, w, b, qkv, logits = f32(2, 3, 4), f32(4), f32(4), f32(2, 3, 12), f32(2, 3, 6)
    out = {}
    out["encoder_forward"] = ref.encoder_forward(inp, f32(6, 4), f32(5, 4))
    out["encoder dwte"], out["encoder dwpe"] = ref.encoder_backward(x, inp, (6, 4), (5, 4))
    out["layernorm_forward"], mean, rstd = ref.layernorm_forward(x, w, b)
    out["layernorm mean"], out["layernorm rstd"] = mean, rstd
    dx, dw, db = ref.layernorm_backward(x, x, w, mean, rstd)
    out["layernorm dx"], out["layernorm dw"], out["layernorm db"] = dx, dw, db
    out["matmul_forward"] = ref.matmul_forward(x, f32(5, 4), f32(5))
    dx, dw, dbias = ref.matmul_backward(f32(2, 3, 5), x, f32(5, 4), True)
    out["matmul dx"], out["matmul dw"], out["matmul dbias"] = dx, dw, dbias
    out["attention_forward"], out["attention att"] = ref.attention_forward(qkv, 2)
    out["attention dqkv"] = ref.attention_backward(x, qkv, out["attention att"], 2)
    out["gelu_forward"], out["gelu dx"] = ref.gelu_forward(x), ref.gelu_backward(x, x)
    out["residual_forward"] = ref.residual_forward(x, x)
    out["residual da"], out["residual db"] = ref.residual_backward(x)
    out["crossentropy losses"], probs = ref.crossentropy_forward(logits, targets, 5)
    out["crossentropy probs"] = probs
    out["crossentropy dlogits"] = ref.crossentropy_backward(probs, targets, f32(2, 3))
    p, m, v = ref.adamw_update(w, b, w * 0, w * 0, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.7)
    out["adamw param"], out["adamw m"], out["adamw v"] = p, m, v
    wrong = {name: a.dtype for name, a in out.items() if a.dtype != np.float32}
    assert not wrong
    assert all(np.all(np.isfinite(a)) for a in out.values())


def test_gpt2_in_float32_stays_float32_and_is_close_to_float64():
    rng = np.random.default_rng(0)
    params64 = random_params(TINY, rng)
    inp, targets = tiny_batch(rng)
    params32 = {name: a.astype(np.float32) for name, a in params64.items()}
    logits, loss32, cache = gpt2_forward(params32, TINY, inp, targets)
    grads = gpt2_backward(params32, TINY, cache)
    assert logits.dtype == np.float32 and cache["probs"].dtype == np.float32
    assert {grads[name].dtype for name in PARAM_NAMES} == {np.dtype(np.float32)}
    rounded64 = {name: a.astype(np.float64) for name, a in params32.items()}   # the same numbers, in float64
    _, loss64, cache64 = gpt2_forward(rounded64, TINY, inp, targets)
    assert loss32 == pytest.approx(loss64, abs=1e-5)
    np.testing.assert_allclose(grads["wte"], gpt2_backward(rounded64, TINY, cache64)["wte"], atol=1e-5)
