"""What a metric is, and the window of steps it is computed over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Window:
    """Global counts summed over a span of steps, and what a metric needs besides them."""
    counts: Mapping[str, float]    # `EpochTotals.counts()` over the span: samples, loss_sum,
                                   # correct, steps, compute_s, comm_s, step_wall_s, data_s, and
                                   # the policies' `StepResult.sums`
    seconds: float                 # the span's wall time
    lr: float | None = None        # the learning rate of its last step
    per_sample: int = 1            # predictions per sample (accuracy's denominator)

    def __getitem__(self, key: str) -> float:
        """A count over the span (0 when no step added to it)."""
        return float(self.counts.get(key, 0.0))


class Metric:
    """One number computed from a `Window`, and where it is shown."""

    step_key: str | None = None    # its key in steps.jsonl, and TensorBoard's `train/<step_key>`
    epoch_key: str | None = None   # its key in metrics.jsonl, and TensorBoard's `epoch/<epoch_key>`
    label: str | None = None       # its label in the progress display (None: not shown there)

    def value(self, window: Window) -> float | None:
        """The metric over `window`; None where it is undefined (no samples yet)."""
        raise NotImplementedError
