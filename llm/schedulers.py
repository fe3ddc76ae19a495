"""Learning-rate schedules, as llm.c's llmc/schedulers.h (the -k, -l, -u and -q flags)."""
import math

SCHEDULERS = ("cosine", "linear", "constant", "wsd")


class LRScheduler:
    """lr(step) for a 0-based step, with warmup W, S total steps and the final fraction f of lr_max.

      warmup (all but constant): step < W -> lr_max * (step + 1) / W
      cosine    min_lr + 0.5 * (1 + cos(pi * r)) * (lr_max - min_lr),  r = (step - W) / (S - W)
      linear    lr_max - r * (lr_max - min_lr)
      constant  lr_max
      wsd       lr_max until D = int(0.8 S), then
                min_lr + (1 - sqrt((step - D) / (S - D))) * (lr_max - min_lr)
    """

    def __init__(self, kind, lr_max, warmup, total_steps, final_frac):
        if kind not in SCHEDULERS:
            choices = ", ".join(SCHEDULERS)
            raise ValueError(f"unknown learning rate scheduler '{kind}': choose one of {choices}")
        self.kind, self.lr_max, self.warmup, self.total = kind, lr_max, warmup, total_steps
        self.min_lr = lr_max * final_frac

    def __call__(self, step):
        lr_max, min_lr, W, S = self.lr_max, self.min_lr, self.warmup, self.total
        if self.kind == "constant":
            return lr_max
        if step < W:
            return lr_max * (step + 1) / W
        if self.kind == "wsd":
            decay_start = int(0.8 * S)
            if step < decay_start:
                return lr_max
            r = (step - decay_start) / max(S - decay_start, 1)
            return min_lr + (1 - math.sqrt(min(r, 1.0))) * (lr_max - min_lr)
        r = min((step - W) / max(S - W, 1), 1.0)
        if self.kind == "cosine":
            return min_lr + 0.5 * (1 + math.cos(math.pi * r)) * (lr_max - min_lr)
        return lr_max - r * (lr_max - min_lr)  # linear
