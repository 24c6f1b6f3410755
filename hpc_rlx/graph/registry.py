"""The two tables the engine runs on: op definitions (type rule + forward) and VJP rules.

An op is registered once with ``defop``; its gradient rules separately with ``defvjp``, one
function per argument (``None`` for an argument that has no gradient, such as integer ids).
Keeping them as tables makes a missing rule a lookup failure with the op's name in it, rather
than a method someone forgot to override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from hpc_rlx.graph.shapes import ShapeError

REQUIRED = object()  # marks an attribute without a default


@dataclass(frozen=True)
class OpDef:
    """``forward(xp, args, attrs, ctx) -> (out, saved)``; ``infer(types, attrs) -> TensorType``."""

    name: str
    forward: Callable
    infer: Callable
    arity: tuple  # (min inputs, max inputs)
    attrs: dict = field(default_factory=dict)  # name -> default or REQUIRED
    check: Callable | None = None  # attrs -> normalised attrs (raises ShapeError)
    arg_names: tuple = ()

    def normalise(self, raw: dict) -> dict:
        unknown = sorted(set(raw) - set(self.attrs))
        if unknown:
            allowed = ", ".join(sorted(self.attrs)) or "none"
            raise ShapeError(f"unknown attribute(s) {unknown} for op '{self.name}' (allowed: {allowed})")
        out = {}
        for key, default in self.attrs.items():
            if key in raw:
                out[key] = raw[key]
            elif default is REQUIRED:
                raise ShapeError(f"op '{self.name}' needs attribute '{key}'")
            else:
                out[key] = default
        return self.check(out) if self.check else out


@dataclass(frozen=True)
class VJPRule:
    """Per-argument cotangent functions ``fn(xp, g, args, ans, saved, attrs, out) -> array``.

    ``out`` is either None or a preallocated array of the argument's shape (a gradient view);
    a rule may write into it and return it. ``needs_args`` / ``needs_ans`` tell the executor
    which forward values must stay alive for the backward pass; everything else is freed early.
    """

    fns: tuple
    needs_args: tuple  # argument positions read by the rules
    needs_ans: bool


OPS: dict[str, OpDef] = {}
VJPS: dict[str, VJPRule] = {}


def defop(name, infer, arity, attrs=None, check=None, arg_names=()):
    """Decorator registering ``forward`` under ``name``."""

    def register(forward):
        if name in OPS:
            raise ValueError(f"op '{name}' is already registered")
        OPS[name] = OpDef(name, forward, infer, tuple(arity), dict(attrs or {}), check, tuple(arg_names))
        return forward

    return register


def register_op(name, forward, infer, arity, attrs=None, check=None, arg_names=()):
    """Register a user op (the same as ``defop`` without the decorator)."""
    return defop(name, infer, arity, attrs, check, arg_names)(forward)


def unregister_op(name: str) -> None:
    OPS.pop(name, None)
    VJPS.pop(name, None)


def defvjp(name, *fns, needs_args=None, needs_ans=False):
    """Register the VJP functions of op ``name``, one per argument position.

    ``needs_args=None`` means every argument is kept for the backward pass.
    """
    if name in VJPS:
        raise ValueError(f"VJP for op '{name}' is already registered")
    if needs_args is None:
        needs_args = tuple(range(len(fns)))
    VJPS[name] = VJPRule(tuple(fns), tuple(needs_args), bool(needs_ans))


def vjp_fn(name: str, position: int):
    """The VJP function of ``name`` for argument ``position``, or None if there is none."""
    rule = VJPS.get(name)
    if rule is None or position >= len(rule.fns):
        return None
    return rule.fns[position]
