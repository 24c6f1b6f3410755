"""A weighted loss's mean over the global batch (`model.class_weights`, `model.ignore_index`).

PyTorch's weighted cross-entropy divides the summed, weighted loss by the summed weight of the
batch's labelled positions, not by its sample count. Each lane therefore weighs its gradient by
its micro-batch's summed weight (`runtime/lanes.py`), and that weight and the labelled count
travel in the fused bucket beside the sample count (`WEIGHT_FIELDS`), so one rank, two ranks,
two lanes and `train.accumulate` all divide by the same global sum. Batch norm's statistics
stay weighted by rows. Pure NumPy: no MPI.
"""

from __future__ import annotations

from hpc_rlx.graph.loss_options import weighted_loss

WEIGHT_FIELDS: tuple[str, ...] = ("loss_weight", "labelled")
"""The summed fields of a weighted loss: its mean's denominator and the labelled positions."""


def is_weighted(spec) -> bool:
    return weighted_loss(spec.graph)


def mean_scale(payload, n_trainable: int, weight: float, samples: float) -> float:
    """The factor that turns the summed bucket into the step's mean: 1 / the summed label
    weight for the gradients. The buffers' statistics (after `n_trainable`), weighted by rows,
    are rescaled in place so the same factor gives their mean over `samples`. A batch without
    a labelled position (weight 0) has a zero gradient (PyTorch: NaN)."""
    if weight <= 0:
        payload[:n_trainable] = 0
        return 1.0 / samples
    if payload.shape[0] > n_trainable:
        payload[n_trainable:] *= weight / samples
    return 1.0 / weight


def local_mean(payload, n_trainable: int, counted, samples: int, loss_sum: float,
               correct: float, per_sample: int) -> tuple[float, float, float]:
    """cadence/async: a local step of a weighted loss takes its own batch's mean (what one rank
    of PyTorch computes); (the gradient factor, and the loss and correct counts rescaled so the
    epoch's sample-weighted means are the means of those local means). `counted`: the lanes'
    (summed label weight, labelled positions)."""
    weight, labelled = counted
    scale = mean_scale(payload, n_trainable, weight, samples)
    loss = loss_sum / weight * samples if weight > 0 else 0.0
    accuracy = correct / labelled * samples * per_sample if labelled > 0 else 0.0
    return scale, loss, accuracy
