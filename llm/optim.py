"""Optimizer settings, learning-rate schedules, gradient clipping and the outlier detector, as llm.c.

AdamW's element-wise update itself is a backend op (reference/adamw.py on the CPU, a CUDA kernel on
the GPU); llm/zero.py decides which slice of the flat buffers each rank updates.
"""
import math

# llm.c's train_gpt2.cu hard-codes these at the AdamW call site
BETA1, BETA2, EPS = 0.9, 0.95, 1e-8
GRAD_CLIP = 1.0

SCHEDULERS = ("cosine", "linear", "constant", "wsd")


class LRScheduler:
    """lr(step) for a 0-based step, with warmup W, S total steps and the final fraction f of lr_max.

      warmup (all but constant): step < W -> lr_max * (step + 1) / W
      cosine    min_lr + 0.5 * (1 + cos(pi * r)) * (lr_max - min_lr),  r = (step - W) / (S - W)
      linear    lr_max - r * (lr_max - min_lr)
      constant  lr_max
      wsd       lr_max until D = int(0.8 S), then min_lr + (1 - sqrt((step - D) / (S - D))) * (lr_max - min_lr)
    """

    def __init__(self, kind, lr_max, warmup, total_steps, final_frac):
        if kind not in SCHEDULERS:
            raise ValueError(f"unknown learning rate scheduler '{kind}': choose one of {', '.join(SCHEDULERS)}")
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


def clip_scale(grad_norm, clip=GRAD_CLIP):
    """The factor AdamW multiplies each gradient by so that the global norm is at most `clip`."""
    return clip / grad_norm if grad_norm > clip else 1.0


class OutlierDetector:
    """z-score of a value against the last 128 values (llm.c's outlier_detector.h): nan until the window fills."""
    WINDOW = 128

    def __init__(self):
        self.values = []

    def update(self, x):
        """Push x into the window (dropping the oldest once full) and return its z-score within it."""
        full = len(self.values) == self.WINDOW
        if full:
            self.values.pop(0)
        self.values.append(float(x))
        if not full:
            return math.nan
        mean = sum(self.values) / self.WINDOW
        std = math.sqrt(max(sum(v * v for v in self.values) / self.WINDOW - mean * mean, 0.0))
        return 0.0 if std == 0 else (x - mean) / std
