"""The metrics every run records."""

from __future__ import annotations

from .base import Metric, Window


class TrainLoss(Metric):
    """The mean training loss of the span's samples (a skipped step's are not counted); a
    weighted loss's over its summed label weight (`policies/loss_weight.py`)."""
    step_key, epoch_key, label = "loss", "train_loss", "loss"

    def value(self, window: Window) -> float | None:
        n = window["loss_weight"] if "loss_weight" in window.counts else window["samples"]
        return window["loss_sum"] / n if n > 0 else None


class TrainAccuracy(Metric):
    """The fraction of correct predictions over the span's labelled positions (pixel accuracy
    for a label per pixel; an ignored label's positions left out)."""
    epoch_key = "train_accuracy"

    def value(self, window: Window) -> float | None:
        n = window["labelled"] if "labelled" in window.counts else window["samples"] * window.per_sample
        return window["correct"] / n if n > 0 else None


class SamplesPerSecond(Metric):
    """Global training samples per second of the span's wall time."""
    step_key = epoch_key = "samples_per_s"

    def value(self, window: Window) -> float | None:
        return window["samples"] / window.seconds if window.seconds > 0 else None


class LearningRate(Metric):
    """The learning rate of the span's last step."""
    step_key = epoch_key = "lr"

    def value(self, window: Window) -> float | None:
        return window.lr
