"""Gradient clipping by the global L2 norm."""

from __future__ import annotations

import math

from hpc_rlx.checks import Check, is_real


def clip_grad_norm_(grads_flat, max_norm: float) -> float:
    """Scale ``grads_flat`` in place so its L2 norm is at most ``max_norm``; return the norm before.

    Like torch.nn.utils.clip_grad_norm_ (coefficient ``max_norm / (norm + 1e-6)``), except that a
    non-finite norm leaves the gradients untouched: the caller sees it and can skip the step.
    """
    Check(lambda v: is_real(v) and float(v) > 0.0, "must be a number > 0")("gradient clipping max_norm",
                                                                          max_norm)
    # dot of a 1-D array with itself: no full-size temporary, one reduction on either backend
    norm = math.sqrt(float(grads_flat.dot(grads_flat))) if grads_flat.size else 0.0
    if math.isfinite(norm) and norm > max_norm:
        grads_flat *= float(max_norm) / (norm + 1e-6)
    return norm
