"""llm/step.py's order of work: without -sl/-sg the update is queued before the host reads the loss and the
norm, so that the GPU goes from the gradients to AdamW with no wait; with them, the host's verdict comes
first. A model and an optimizer that only write down what is asked of them show the order."""
import numpy as np
import pytest

from llm.outliers import UpdateGuard
from llm.step import train_step


class Recorder:
    """Answers every call of train_step's with a plausible value, and writes its name down."""

    def __init__(self, calls, loss=2.0, grad_norm=0.5):
        self.calls, self.values = calls, (loss, grad_norm)

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return self.values if name == "read" else np.zeros(2, np.float32)
        return call


def steps(guard, loss=2.0):
    calls = []
    model, optimizer = Recorder(calls), Recorder(calls, loss=loss)
    batch = (np.zeros((1, 4), np.int32), np.zeros((1, 4), np.int32))
    result = train_step(model, optimizer, [batch, batch], 1e-3, 1, guard)
    return calls, result


def test_without_z_scores_the_update_is_queued_before_the_host_reads_the_loss_and_norm():
    calls, result = steps(UpdateGuard())
    assert calls == ["zero_grad", "forward", "backward", "forward", "backward", "reduce_gradients",
                     "loss_and_norm", "update", "gather_params", "read"]
    assert (result.loss, result.grad_norm, result.skipped) == (2.0, 0.5, None)


def test_a_non_finite_step_is_reported_as_skipped_though_the_device_decided_it():
    calls, result = steps(UpdateGuard(), loss=float("nan"))
    assert calls[-3:] == ["update", "gather_params", "read"]   # queued: clip_scale's NaN makes it a no-op
    assert result.skipped.startswith("skipping update: non-finite loss nan")


@pytest.mark.parametrize("loss, updated", [(2.0, True), (float("nan"), False)])
def test_with_z_scores_the_host_reads_first_and_decides(loss, updated):
    calls, result = steps(UpdateGuard(loss_threshold=3.0), loss=loss)
    assert calls[6:8] == ["loss_and_norm", "read"]
    assert ("update" in calls) == updated and ("gather_params" in calls) == updated
