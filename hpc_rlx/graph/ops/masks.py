"""Ops whose outputs carry no gradient: value tests (``isnan``, ``isinf``), comparisons
(``compare``) and logic (``logical``) on data, as int64 0/1 masks (conventions in
``hpc_rlx.graph.ops``).

They let a model build its masks at run time (an attention mask from the scores, padding from
the token ids); ``where`` reads such a mask as its condition. Their outputs are int64, so the
executor never differentiates them: gradients flow through the float paths they select.
"""

from __future__ import annotations

from hpc_rlx.graph.registry import REQUIRED, defop
from hpc_rlx.graph.shapes import INT, ShapeError, TensorType, broadcast, require_float

_COMPARE = {
    "equal": lambda xp: xp.equal,
    "less": lambda xp: xp.less,
    "less_equal": lambda xp: xp.less_equal,
    "greater": lambda xp: xp.greater,
    "greater_equal": lambda xp: xp.greater_equal,
}
_LOGIC = {
    "not": lambda xp: xp.logical_not,
    "and": lambda xp: xp.logical_and,
    "or": lambda xp: xp.logical_or,
    "xor": lambda xp: xp.logical_xor,
}


def _test_type(types, a):
    require_float(types[0], "input")
    return TensorType(types[0].shape, INT)


@defop("isnan", _test_type, (1, 1))
def isnan(xp, args, a, ctx):
    return xp.isnan(args[0]).astype(xp.int64), None


@defop("isinf", _test_type, (1, 1), attrs={"detect_negative": True, "detect_positive": True})
def isinf(xp, args, a, ctx):
    x = args[0]
    hit = xp.isinf(x)
    if not a["detect_negative"]:
        hit &= x > 0
    if not a["detect_positive"]:
        hit &= x < 0
    return hit.astype(xp.int64), None


def _kind_check(table):
    def check(a):
        if a["kind"] not in table:
            raise ShapeError(f"attribute 'kind' must be one of {', '.join(sorted(table))}, got {a['kind']!r}")
        return a

    return check


def _mask_type(types, a):
    shape = types[0].shape
    for t in types[1:]:
        shape = broadcast(shape, t.shape, "operands")
    return TensorType(shape, INT)


@defop("compare", _mask_type, (2, 2), attrs={"kind": REQUIRED}, check=_kind_check(_COMPARE))
def compare(xp, args, a, ctx):
    return _COMPARE[a["kind"]](xp)(args[0], args[1]).astype(xp.int64), None


def _logic_type(types, a):
    if (a["kind"] == "not") != (len(types) == 1):
        raise ShapeError(f"logical '{a['kind']}' takes {'one operand' if a['kind'] == 'not' else 'two operands'}")
    return _mask_type(types, a)


@defop("logical", _logic_type, (1, 2), attrs={"kind": REQUIRED}, check=_kind_check(_LOGIC))
def logical(xp, args, a, ctx):
    return _LOGIC[a["kind"]](xp)(*args).astype(xp.int64), None
