"""The training metrics: each computed in one place, rendered by every output.

A metric (`base.Metric`) computes one number from a `base.Window`: the global counts a span of
steps summed (a step record's span, an epoch, the epoch so far), its wall time and the
learning rate. Every output renders the same metrics from the same counts:

- `steps.jsonl` and TensorBoard's `train/<step_key>`: per recorded step (`step_values`);
- `metrics.jsonl` and TensorBoard's `epoch/<epoch_key>`: per epoch (`epoch_values`);
- the progress line and bar: those with a `label` (`shown`).

Adding a metric: one file defining a `Metric` subclass, and one line in `registry.METRICS`.
A metric that needs a number the counts lack has the policy's step add it to
`StepResult.sums` (one line where it is computed). Pure: no MPI, no files.
"""

from .base import Metric, Window
from .registry import METRICS, epoch_values, shown, step_values

__all__ = ["METRICS", "Metric", "Window", "epoch_values", "shown", "step_values"]
