"""Gradient clipping by the global L2 norm."""

from __future__ import annotations

import math

from hpc_rlx.base.checks import Check, is_real


def clip_grad_norm_(grads_flat, max_norm: float) -> float:
    """Scale ``grads_flat`` in place so its L2 norm is at most ``max_norm``; return the norm before.

    Like torch.nn.utils.clip_grad_norm_ (coefficient ``max_norm / (norm + 1e-6)``), except that a
    non-finite norm leaves the gradients untouched: the caller sees it and can skip the step.
    """
    norm = math.sqrt(squared_norm(grads_flat))
    scale_to_norm_(grads_flat, max_norm, norm)
    return norm


def squared_norm(grads_flat) -> float:
    """The squared L2 norm (a slice's share of the global norm, under sharded state)."""
    # dot of a 1-D array with itself: no full-size temporary, one reduction on either backend
    return float(grads_flat.dot(grads_flat)) if grads_flat.size else 0.0


def scale_to_norm_(grads_flat, max_norm: float, norm: float) -> None:
    """Clip ``grads_flat``, part of a gradient whose global L2 norm is ``norm``, as
    `clip_grad_norm_` clips the whole."""
    Check(lambda v: is_real(v) and float(v) > 0.0, "must be a number > 0")("gradient clipping max_norm",
                                                                          max_norm)
    if math.isfinite(norm) and norm > max_norm:
        grads_flat *= float(max_norm) / (norm + 1e-6)
