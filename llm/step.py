"""One training step, written once: train_gpt2.py, test_gpt2.py and bench/step.py all run this function.

It reads as llm.c's main loop: forward and backward for each micro-batch (the gradients accumulate),
then reduce the gradients across ranks, take their global norm, clip, update and gather.
"""
from dataclasses import dataclass

from .zero import clip_scale


@dataclass
class StepResult:
    loss: float        # mean loss over every position of the step, on every rank
    grad_norm: float   # global norm of the averaged gradients, before clipping
    loss_z: float      # z-scores against the last 128 steps (nan until the window fills)
    norm_z: float
    skipped: str       # why the update was skipped, or None when it was applied


def train_step(model, optimizer, batches, lr, t, guard):
    """One optimizer step over `batches`, this rank's micro-batches [(inputs, targets), ...] of (B, T) ids.

    t is the 1-based step for AdamW's bias correction; guard (llm/outliers.py) decides whether the update
    goes ahead once the loss and norm are known."""
    B, T = batches[0][0].shape
    positions = B * T * len(batches)
    model.zero_grad()
    loss_sum = 0.0
    for inputs, targets in batches:
        model.forward(inputs)
        losses = model.backward(targets, dloss=1.0 / positions)   # the mean over the step's positions
        loss_sum = loss_sum + losses.sum()   # stays on the device until the norm is read
    optimizer.reduce_gradients()
    grad_norm = optimizer.grad_norm()   # the step's one wait for the device: the loss sum is ready by then
    loss = optimizer.comm.scalar_avg(float(loss_sum)) / positions
    loss_z, norm_z, skipped = guard.check(loss, grad_norm)
    if skipped is None:
        optimizer.update(lr, t, grad_scale=clip_scale(grad_norm))
        optimizer.gather_params()
    return StepResult(loss, grad_norm, loss_z, norm_z, skipped)
