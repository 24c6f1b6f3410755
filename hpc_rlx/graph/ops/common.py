"""What the op modules share: the type rule of a float op that keeps its input's type, attribute
checks, and the VJP helpers that undo broadcasting and sum into a gradient view."""

from __future__ import annotations

import math

from hpc_rlx.graph.shapes import ShapeError, require_float


def same_float(types, attrs):
    require_float(types[0], "input")
    return types[0]


def int_attr(name):
    def check(a):
        if isinstance(a[name], bool) or not isinstance(a[name], int):
            raise ShapeError(f"attribute '{name}' must be an int, got {a[name]!r}")
        return a

    return check


def finite_number(value, name, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ShapeError(f"attribute '{name}' must be a finite number{' or null' if allow_none else ''}, got {value!r}")
    return float(value)


def unbroadcast(xp, g, shape):
    """Sum ``g`` down to ``shape``: over leading dims it gained and dims that were 1."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1
    )
    return g.sum(axis=axes).reshape(shape)


def sum_to(xp, g, axes, out):
    """``g.sum(axes)`` written into ``out`` when one is given."""
    if out is not None:
        xp.sum(g, axis=axes, out=out)
        return out
    return g.sum(axis=axes)
