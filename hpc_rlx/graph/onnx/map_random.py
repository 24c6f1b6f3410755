"""Random draws in an exported model: ``RandomUniformLike``, ``RandomNormalLike``, ``Bernoulli``,
and the mask the exporters write for stochastic depth and for dropout written by hand.

PyTorch's ``torch.empty(...).bernoulli_(keep)`` (torchvision's StochasticDepth, timm's
DropPath) exports as a uniform draw compared with a constant: ``Less(RandomUniformLike(t), keep)``,
cast to float, divided by ``keep``, multiplied in. The comparison becomes one IR ``bernoulli``
draw with that probability (``hpc_rlx/graph/ops/random.py``): training draws the mask from the
step seed, and evaluation takes its expectation, so the divided mask is 1 there, as in the
model's eval mode. The mask is a float 0/1 tensor (ONNX's is boolean): the cast that follows in
these files is then the identity.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.onnx.emit import Tensor
from hpc_rlx.graph.onnx.fold import Folded
from hpc_rlx.graph.onnx.map_math import cast_to, float_tensor, mask
from hpc_rlx.graph.shapes import FLOAT


def _like(em, v) -> Tensor:
    """The draw's shape source, as a float tensor (the values are never read)."""
    t = em.as_tensor(v)
    return t if t.dtype == FLOAT else cast_to(em, t, np.float32)


def _float_output(em, at, op_type: str) -> None:
    dtype = at.get("dtype")
    if dtype is not None and int(dtype) not in (1, 10, 11, 16):
        raise em.fail(f"{op_type} of an integer dtype ({dtype}): only float draws are supported")


def random_uniform_like(em, ins, at, n):
    _float_output(em, at, "RandomUniformLike")
    like = _like(em, ins[0])
    low, high = float(at.get("low", 0.0)), float(at.get("high", 1.0))
    out = em.tensor("random_like", [like], like.groups, dist="uniform", a=low, b=high)
    em.uniform_draws[out.name] = (like, low, high)
    em.expectations[em.output_name] = (low + high) / 2
    return [out]


def random_normal_like(em, ins, at, n):
    _float_output(em, at, "RandomNormalLike")
    like = _like(em, ins[0])
    mean = float(at.get("mean", 0.0))
    em.expectations[em.output_name] = mean
    return [em.tensor("random_like", [like], like.groups, dist="normal", a=mean, b=float(at.get("scale", 1.0)))]


def bernoulli(em, ins, at, n):
    _float_output(em, at, "Bernoulli")
    p = float_tensor(em, ins[0], "Bernoulli's probabilities")
    return [em.tensor("bernoulli", [p], p.groups)]


def compare(kind: str):
    """A comparison: a uniform draw against a constant is a Bernoulli draw (a random mask);
    anything else the no-gradient mask of ``map_math.mask``."""
    as_mask = mask("compare", kind=kind)

    def emit(em, ins, at, n):
        drawn = _draw_against_constant(em, ins, kind)
        return [drawn] if drawn is not None else as_mask(em, ins, at, n)

    return emit


def _draw_against_constant(em, ins, kind: str):
    a, b = ins
    reversed_ = False
    if isinstance(b, Tensor) and b.name in em.uniform_draws:
        a, b, reversed_ = b, a, True           # c < u is u > c
    if not (isinstance(a, Tensor) and a.name in em.uniform_draws and isinstance(b, Folded)
            and b.const and b.value.size == 1 and b.value.ndim <= a.rank):
        return None
    like, low, high = em.uniform_draws[a.name]
    c = float(np.asarray(b.value, np.float64).reshape(()))
    # P(u < c) for u uniform on [low, high); a continuous draw: < and <= alike
    below = float(np.clip((c - low) / (high - low), 0.0, 1.0)) if high > low else float(low < c)
    less = kind in ("less", "less_equal")
    prob = below if less != reversed_ else 1.0 - below
    em.expectations[em.output_name] = prob
    p = em.constant(np.float32(prob))
    # the probability everywhere the draw is (where() reads any value as its condition)
    probs = em.tensor("where", [like, p, p], like.groups)
    return em.tensor("bernoulli", [probs], like.groups)
