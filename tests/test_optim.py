"""LR schedules, clipping and the outlier detector follow llm.c's formulas; the update guard's state and its
rule for diverged runs."""
import math
import random

import numpy as np
import pytest

from llm.outliers import DivergedError, OutlierDetector, UpdateGuard
from llm.schedulers import LRScheduler
from llm.zero import clip_scale


def test_warmup_ramps_linearly_to_lr_max():
    s = LRScheduler("cosine", 1e-3, warmup=10, total_steps=100, final_frac=0.1)
    assert [s(i) for i in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])


def test_cosine_decays_from_lr_max_to_final_fraction():
    s = LRScheduler("cosine", 1e-3, warmup=10, total_steps=110, final_frac=0.1)
    assert s(10) == pytest.approx(1e-3)
    assert s(60) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))      # halfway: cos(pi/2) = 0
    assert s(110) == pytest.approx(1e-4)


def test_linear_decays_in_a_straight_line():
    s = LRScheduler("linear", 1.0, warmup=0, total_steps=10, final_frac=0.0)
    assert [s(i) for i in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])


def test_constant_ignores_warmup():
    s = LRScheduler("constant", 3e-4, warmup=50, total_steps=100, final_frac=0.0)
    assert s(0) == s(99) == 3e-4


def test_wsd_is_flat_then_decays_with_a_square_root_over_the_last_fifth():
    s = LRScheduler("wsd", 1.0, warmup=0, total_steps=100, final_frac=0.0)
    assert s(79) == 1.0
    assert s(80) == 1.0                                   # r = 0
    assert s(85) == pytest.approx(1 - math.sqrt(5 / 20))
    assert s(100) == pytest.approx(0.0)


def test_default_final_fraction_makes_cosine_constant():
    s = LRScheduler("cosine", 3e-4, warmup=0, total_steps=100, final_frac=1.0)
    assert all(s(i) == pytest.approx(3e-4) for i in range(100))


def test_unknown_scheduler_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown learning rate scheduler 'cosin'"):
        LRScheduler("cosin", 1e-3, 0, 10, 1.0)


def test_clipping_scales_the_norm_down_to_one_and_is_nan_for_a_non_finite_step():
    """clip_scale takes [loss sum, squared norm] where they are and gives a 0-d float32 there."""
    def scale(loss, sumsq):
        out = clip_scale(np, np.array([loss, sumsq], np.float32))
        assert out.dtype == np.float32 and out.shape == ()
        return float(out)
    assert scale(2.0, 16.0) == 0.25                       # norm 4
    assert scale(2.0, 0.25) == 1.0 and scale(2.0, 1.0) == 1.0 and scale(2.0, 0.0) == 1.0
    assert scale(2.0, 3.0) == np.float32(1 / math.sqrt(3.0))   # as the host computes it, rounded once
    for loss, sumsq in ((np.nan, 1.0), (np.inf, 1.0), (2.0, np.inf), (2.0, np.nan)):
        assert math.isnan(scale(loss, sumsq))


def test_outlier_detector_is_nan_until_its_window_fills_then_gives_z_scores():
    d = OutlierDetector()
    zs = [d.update(float(i % 2)) for i in range(128)]   # 0, 1, 0, 1, ...
    assert all(math.isnan(z) for z in zs)
    assert d.update(0.0) == pytest.approx(-1.0)          # window of 64 zeros, 64 ones: mean 0.5, std 0.5
    assert d.update(1.0) == pytest.approx(1.0)
    d = OutlierDetector()
    for _ in range(128):
        d.update(3.0)
    assert d.update(3.0) == 0.0                          # zero spread gives z = 0


def test_a_guard_restored_from_its_state_decides_as_the_one_that_went_on():
    rng = random.Random(0)
    steps = [(10 + rng.random(), 1 + rng.random()) for _ in range(200)]
    going_on = UpdateGuard(loss_threshold=0.5, norm_threshold=0.5)
    decisions = [going_on.check(*s) for s in steps[:150]]
    restored = UpdateGuard(loss_threshold=0.5, norm_threshold=0.5)
    restored.load_state(**going_on.state())
    rest = [going_on.check(*s) for s in steps[150:]]
    assert [restored.check(*s) for s in steps[150:]] == rest
    assert any(skipped for *_, skipped in decisions + rest)


def test_the_guard_stops_a_run_after_max_nonfinite_steps_in_a_row():
    guard = UpdateGuard(max_nonfinite=3)
    nan = float("nan")
    for loss, norm in [(nan, 1.0), (1.0, math.inf), (1.0, 1.0),   # a finite step resets
                       (nan, nan), (nan, 1.0)]:
        guard.check(loss, norm)
    assert guard.state()["nonfinite_streak"] == 2
    with pytest.raises(DivergedError, match="stopping: 3 steps in a row had a non-finite loss or grad norm"):
        guard.check(nan, nan)
    never = UpdateGuard(max_nonfinite=0)
    assert all(never.check(nan, nan)[2].startswith("skipping update: non-finite") for _ in range(1000))
