"""Outlier detection and the rule for skipping an update, as llm.c's llmc/outlier_detector.h and its main loop.

The step's loss and gradient norm are compared with their last 128 values; an update whose z-score is above
the -sl (loss) or -sg (norm) threshold is skipped, and so is one with a non-finite loss or norm, which would
otherwise turn every parameter into NaN.
"""
import math


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


class UpdateGuard:
    """Decides, once a step's loss and gradient norm are known, whether its update goes ahead.

    loss_threshold, norm_threshold: the -sl and -sg z-score limits (0: off). The z-scores are always
    computed, for the step line, and the windows see every step, skipped ones included, as in llm.c."""

    def __init__(self, loss_threshold=0.0, norm_threshold=0.0):
        self.loss_threshold, self.norm_threshold = loss_threshold, norm_threshold
        self.loss_window, self.norm_window = OutlierDetector(), OutlierDetector()

    def check(self, loss, grad_norm):
        """-> (loss z-score, norm z-score, why the update is skipped, or None to go ahead)."""
        loss_z, norm_z = self.loss_window.update(loss), self.norm_window.update(grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return loss_z, norm_z, f"skipping update: non-finite loss {loss} or grad norm {grad_norm}"
        if self.loss_threshold and loss_z > self.loss_threshold:
            return loss_z, norm_z, f"skipping update due to loss z-score of {loss_z:f}"
        if self.norm_threshold and norm_z > self.norm_threshold:
            return loss_z, norm_z, f"skipping update due to grad z-score of {norm_z:f}"
        return loss_z, norm_z, None
