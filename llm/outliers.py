"""Outlier detection and the rule for skipping an update, as llm.c's llmc/outlier_detector.h and main loop.

The step's loss and gradient norm are compared with their last 128 values; an update whose z-score is above
the -sl (loss) or -sg (norm) threshold is skipped, and so is one with a non-finite loss or norm, which would
otherwise turn every parameter into NaN. A run whose updates are skipped for a non-finite loss or norm
several steps in a row (--max-nonfinite) has diverged, and stops instead of running on to its end.

The windows and the count of non-finite steps go into the training state file (llm/formats.py), so a
resumed run decides exactly as the uninterrupted run would have.
"""
import math

from llm.launch import UserError


class DivergedError(UserError):
    """Too many non-finite steps in a row: one line saying so and what to do."""


class OutlierDetector:
    """z-score of a value against the last 128 values (llm.c's outlier_detector.h): nan until the window
    fills."""
    WINDOW = 128

    def __init__(self, values=()):
        if len(values) > self.WINDOW:
            raise ValueError(f"an outlier window holds at most {self.WINDOW} values, got {len(values)}")
        self.values = [float(v) for v in values]

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


class UpdateGuard:
    """Decides, once a step's loss and gradient norm are known, whether its update goes ahead.

    loss_threshold, norm_threshold: the -sl and -sg z-score limits (0: off). The z-scores are always
    computed, for the step line, and the windows see every step, skipped ones included, as in llm.c.
    max_nonfinite: after this many non-finite steps in a row, check raises DivergedError (0: never)."""

    def __init__(self, loss_threshold=0.0, norm_threshold=0.0, max_nonfinite=0):
        self.loss_threshold, self.norm_threshold = loss_threshold, norm_threshold
        self.max_nonfinite = max_nonfinite
        self.loss_window, self.norm_window = OutlierDetector(), OutlierDetector()
        self.nonfinite_streak = 0   # non-finite steps in a row, up to the last one checked

    @property
    def uses_z_scores(self):
        """Whether a finite step can be skipped too (-sl, -sg): then the update waits for check(). Without
        them it skips only non-finite steps, as the device itself does (llm/zero.py:clip_scale)."""
        return bool(self.loss_threshold or self.norm_threshold)

    def check(self, loss, grad_norm):
        """-> (loss z-score, norm z-score, why the update is skipped, or None to go ahead)."""
        loss_z, norm_z = self.loss_window.update(loss), self.norm_window.update(grad_norm)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.nonfinite_streak = 0 if finite else self.nonfinite_streak + 1
        if not finite:
            if self.max_nonfinite and self.nonfinite_streak >= self.max_nonfinite:
                raise DivergedError(f"stopping: {self.nonfinite_streak} steps in a row had a non-finite "
                                    f"loss or grad norm (now loss {loss}, norm {grad_norm}); the run has "
                                    f"diverged: lower -l, or resume from an earlier checkpoint")
            return loss_z, norm_z, f"skipping update: non-finite loss {loss} or grad norm {grad_norm}"
        if self.loss_threshold and loss_z > self.loss_threshold:
            return loss_z, norm_z, f"skipping update due to loss z-score of {loss_z:f}"
        if self.norm_threshold and norm_z > self.norm_threshold:
            return loss_z, norm_z, f"skipping update due to grad z-score of {norm_z:f}"
        return loss_z, norm_z, None

    def state(self):
        """What a checkpoint keeps: dict(loss_window, norm_window, nonfinite_streak), as formats.write_state
        takes them."""
        return dict(loss_window=list(self.loss_window.values), norm_window=list(self.norm_window.values),
                    nonfinite_streak=self.nonfinite_streak)

    def load_state(self, loss_window, norm_window, nonfinite_streak):
        """Continue from a state(): the thresholds stay this run's."""
        self.loss_window, self.norm_window = OutlierDetector(loss_window), OutlierDetector(norm_window)
        self.nonfinite_streak = int(nonfinite_streak)
