"""Every metric the outputs render, in the order they appear in the records."""

from __future__ import annotations

from .base import Metric, Window
from .builtin import LearningRate, SamplesPerSecond, TrainAccuracy, TrainLoss
from .wire import WireBytes

METRICS: tuple[Metric, ...] = (
    TrainLoss(),
    TrainAccuracy(),
    LearningRate(),
    SamplesPerSecond(),
    WireBytes(),
)


def step_values(window: Window) -> dict:
    """A steps.jsonl record's metrics."""
    return {m.step_key: m.value(window) for m in METRICS if m.step_key}


def epoch_values(window: Window) -> dict:
    """A metrics.jsonl record's metrics."""
    return {m.epoch_key: m.value(window) for m in METRICS if m.epoch_key}


def shown(window: Window) -> tuple[tuple[str, float | None], ...]:
    """(label, value) of the metrics the progress display shows."""
    return tuple((m.label, m.value(window)) for m in METRICS if m.label)
