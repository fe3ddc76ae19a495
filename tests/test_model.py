"""The model's three entry points on the NumPy backend: forward, backward and validate, with and without
recompute, against the float64 reference."""
import numpy as np
import pytest

from llm.backends import get_backend
from llm.backends.graphs import GraphCache
from llm.backends.numpy_backend import NumpyBackend
from llm.config import GPT2Config
from llm.layout import PARAM_NAMES, ParamViews
from llm.model import GPT2
from llm.weight_init import init_params
from reference import gpt2 as ref
from reference.matmul import matmul_backward as ref_matmul_backward

CONFIG = GPT2Config.from_descriptor("d2c64h4")
B, T = 2, 16


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(3)
    return (rng.integers(0, CONFIG.vocab_size, (B, T), dtype=np.int32),
            rng.integers(0, CONFIG.vocab_size, (B, T), dtype=np.int32))


def model(recompute=1):
    m = GPT2(CONFIG, get_backend("numpy"), recompute=recompute)
    m.load_params(init_params(CONFIG))
    return m


def train_micro_step(m, batch, dloss=1.0 / (B * T)):
    """Logits, then losses and gradients of one forward and backward, as host copies."""
    inputs, targets = batch
    m.zero_grad()
    logits = m.forward(inputs).copy()
    losses = m.backward(targets, dloss).copy()
    return logits, losses, m.grads_numpy()


def test_forward_backward_equal_the_float64_reference(batch):
    logits, losses, grads = train_micro_step(model(), batch)
    p = ParamViews(init_params(CONFIG), CONFIG).copies(np.float64)
    ref_logits, ref_loss, cache = ref.gpt2_forward(p, CONFIG, *batch)
    ref_grads = ref.gpt2_backward(p, CONFIG, cache)
    assert np.abs(logits - ref_logits).max() < 1e-4
    assert abs(losses.mean() - ref_loss) < 1e-5
    for name, g in ParamViews(grads, CONFIG):
        np.testing.assert_allclose(g, ref_grads[name], rtol=1e-3, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("recompute", [1, 2])
def test_recompute_gives_the_same_losses_and_gradients_bit_for_bit(batch, recompute):
    """-r 1 recomputes GELU and -r 2 also the layernorms in the backward: the same numbers, less memory."""
    kept = model(recompute=0)
    again = model(recompute=recompute)
    for _ in range(2):   # twice: the scratch places that recompute reuses must not leak between steps
        want, got = train_micro_step(kept, batch), train_micro_step(again, batch)
        for w, g in zip(want, got):
            assert np.array_equal(w, g)
    assert again.activations(B, T).nbytes < kept.activations(B, T).nbytes
    assert kept.activations(B, T).fch_gelu is not None and again.activations(B, T).fch_gelu is None
    assert (again.activations(B, T).ln1 is None) == (recompute == 2)


class LateWeightGradients(NumpyBackend):
    """The NumPy backend with each weight gradient made as late as the model lets it: when the model waits
    for it or for one queued after it (the GPU's weight gradients run in the order they were queued)."""

    def __init__(self):
        super().__init__()
        self.queued = []   # (done, work) in the order queued

    def matmul_backward(self, dinp, dw, dbias, dout, inp, w):
        super().matmul_backward(dinp, np.zeros_like(dw), dbias, dout, inp, w)   # dinp and dbias now

        def weight_gradient():   # reads dout and inp as they are when it runs
            dw[...] += ref_matmul_backward(dout, inp, w, has_bias=False)[1]
        done = object()
        self.queued.append((done, weight_gradient))
        return done

    def wait(self, done):
        if any(queued is done for queued, _ in self.queued):
            while True:
                queued, work = self.queued.pop(0)
                work()
                if queued is done:
                    return


@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_weight_gradients_made_as_late_as_the_waits_allow_equal_those_made_at_once(batch, recompute):
    """The model waits for each weight gradient before it overwrites what that gradient reads (on the GPU
    they run beside the ops after them): made at its wait instead, each reads the same numbers."""
    at_once, late = model(recompute), GPT2(CONFIG, LateWeightGradients(), recompute=recompute)
    late.load_params(init_params(CONFIG))
    for _ in range(2):
        want, got = train_micro_step(at_once, batch), train_micro_step(late, batch)
        assert late.backend.queued == []   # the backward waits for the last one
        for w, g in zip(want, got):
            assert np.array_equal(w, g)


def test_validate_gives_the_training_losses_without_touching_the_gradients(batch):
    m = model()
    _, train_losses, grads = train_micro_step(m, batch)
    losses = m.validate(*batch)
    assert np.array_equal(losses, train_losses)
    assert np.array_equal(m.grads_numpy(), grads)


def test_backward_needs_a_forward_first(batch):
    m = model()
    with pytest.raises(RuntimeError, match="needs a forward"):
        m.backward(batch[1], 1.0)
    m.forward(batch[0])
    m.backward(batch[1], 1.0)
    with pytest.raises(RuntimeError, match="needs a forward"):   # one backward per forward
        m.backward(batch[1], 1.0)


def test_grads_cover_all_sixteen_tensors(batch):
    _, _, grads = train_micro_step(model(), batch)
    views = ParamViews(grads, CONFIG)
    assert all(np.abs(getattr(views, name)).sum() > 0 for name in PARAM_NAMES)



class Recording:
    """What a CUDA graph is to the model, on the CPU: the work of the call that recorded it, run again on
    every replay (the closure keeps that call's arguments, as a graph keeps its kernels' arguments)."""

    def __init__(self, work, log):
        self.work, self.log = work, log

    def replay(self):
        self.log.append("replay")
        self.work()


def test_graphs_run_directly_once_record_on_the_second_call_and_replay_per_shape_and_dloss(batch):
    plain, graphed, log = model(), model(), []
    cache = GraphCache(lambda work: log.append("record") or Recording(work, log))
    graphed.backend.run = cache.run   # the cupy backend's protocol, on the NumPy backend's ops
    # a new dloss is a new backward graph, not a replay of the old
    for dloss in (1.0, 1.0, 1.0, 0.5, 0.5, 1.0):
        for want, got in zip(train_micro_step(plain, batch, dloss), train_micro_step(graphed, batch, dloss)):
            np.testing.assert_array_equal(got, want)
    # forward: direct, then recorded and replayed 5 times; backward at 1.0: 3 replays, at 0.5: 1
    assert log.count("record") == 3 and log.count("replay") == 5 + 3 + 1
    half = tuple(x[:1] for x in batch)   # a new shape has activations of its own: a new key, run directly
    np.testing.assert_array_equal(train_micro_step(graphed, half)[2], train_micro_step(plain, half)[2])
    assert log.count("record") == 3
