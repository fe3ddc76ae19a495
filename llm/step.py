"""One training step, written once: train_gpt2.py, test_gpt2.py and bench/step.py all run this function.

It reads as llm.c's main loop: forward and backward for each micro-batch (the gradients accumulate),
then reduce the gradients across ranks, take their global norm, clip, update and gather.

The update is queued before the host reads the loss and the norm: the device computes the clipping
factor from the norm, and skips a step whose loss or norm is not finite, by itself. So the GPU goes
straight from the gradients to AdamW, and runs it while the host reads, prints and queues the next step.
Only the -sl/-sg guard, whose z-scores compare the step with the last 128 on the host, makes the update
wait for the host's verdict.
"""
from dataclasses import dataclass


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
        loss_sum = loss_sum + losses.sum()   # stays on the device
    optimizer.reduce_gradients()
    stats = optimizer.loss_and_norm(loss_sum)   # on the device too, summed over the ranks
    if guard.uses_z_scores:   # -sl/-sg: the update waits for the host's verdict
        loss, grad_norm = optimizer.read(stats, positions)
        loss_z, norm_z, skipped = guard.check(loss, grad_norm)
        if skipped is None:
            optimizer.update(lr, t, stats)
            optimizer.gather_params()
    else:   # queued at once; the device skips a non-finite step itself, as guard.check then reports
        optimizer.update(lr, t, stats)
        optimizer.gather_params()
        loss, grad_norm = optimizer.read(stats, positions)   # the step's one wait for the device
        loss_z, norm_z, skipped = guard.check(loss, grad_norm)
    return StepResult(loss, grad_norm, loss_z, norm_z, skipped)
