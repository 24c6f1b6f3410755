"""ONNX -> IR for running sums and index ops: CumSum, ArgMax, GatherElements, GatherND,
ScatterElements, ScatterND, and NonZero as the pooling pattern it serves (see ``map_math`` for
the mapping convention).

Integer tensors computed from the data (position ids from a cumulative sum of the padding
mask, decoder ids shifted right by a scatter) are computed at run time and carry no gradient;
on float data the gradient flows to the data and the updates.

An index into the batch dim cannot be run as such (each lane holds a slice of the batch). The
exporters write per-sample indexing that way, with the sample's number as the first entry of
each index tuple (``arange(batch)`` broadcast); that entry becomes ``batch_dims=1``.

NonZero's output size depends on the data, and the IR's shapes vary only in the batch. The
one use the transformers models make of it is pooling at a token: ``hidden[input_ids == eos]``
reshaped to ``(batch, -1, hidden)`` and the last (or first, or k-th) entry taken per row, as
BART's and T5's sequence classifiers do. That chain, NonZero -> Transpose -> GatherND ->
Reshape -> [Slice of everything] -> Gather on axis 1, is recognised and imported as a gather
by index: per row, the position of the chosen hit is counted from a running sum of the mask.
Each row must hold the token equally often (the transformers models check it in PyTorch; the
check does not reach the file): the import takes each row's own chosen hit, and a row with too
few pools at a position of its own (``_pool_at_hit``). Any other use of NonZero is refused.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx.emit import Tensor, dims_at, single
from hpc_rlx.graph.onnx.fold import TRACE_BATCHES, Folded
from hpc_rlx.graph.shapes import INT


def _ir_axis(t: Tensor, axis: int) -> int:
    return sum(len(g) for g in t.groups[:axis])


def plain_tensor(em, v, what: str) -> Tensor:
    """``v`` as a Tensor with one IR dim per ONNX dim (a merged batch is not indexable)."""
    t = em.as_tensor(v)
    if any(len(g) != 1 for g in t.groups):
        raise em.fail(f"{what} merges the batch with another dim ({t.groups}): index ops need it on its own")
    return t


def _const_int(em, v, what: str) -> int:
    if not isinstance(v, Folded) or not v.const or v.value.size != 1:
        raise em.fail(f"{what} must be a constant")
    return int(np.asarray(v.value).reshape(()))


def as_mask(em, t: Tensor) -> Tensor:
    """``t != 0`` as an int64 0/1 tensor (what a cast to bool, or NonZero, reads)."""
    once = em.tensor("logical", [t], t.groups, kind="not")
    return em.tensor("logical", [once], t.groups, kind="not")


# ---------------------------------------------------------------- cumsum


def cumsum(em, ins, at, n):
    x = plain_tensor(em, ins[0], "CumSum's input")
    axis = _const_int(em, ins[1], "CumSum's axis") % x.rank
    if not x.plain(axis):
        raise em.fail(f"CumSum along axis {axis}, which holds the batch")
    return [em.tensor("cumsum", [x], x.groups, axis=axis, exclusive=bool(at.get("exclusive", 0)),
                      reverse=bool(at.get("reverse", 0)))]


# ---------------------------------------------------------------- argmax


def _argmax_attrs(at, rank: int) -> tuple:
    return at.get("axis", 0) % rank, bool(at.get("keepdims", 1)), bool(at.get("select_last_index", 0))


def fold_argmax(ins, at):
    x = np.asarray(ins[0])
    axis, keep, last = _argmax_attrs(at, x.ndim)
    out = x.shape[axis] - 1 - np.flip(x, axis).argmax(axis) if last else x.argmax(axis)
    return np.expand_dims(out, axis).astype(np.int64) if keep else out.astype(np.int64)


def argmax(em, ins, at, n):
    """On data (a decoder-only classifier's last non-padding token: the largest of position
    times mask): an int64 index without gradient."""
    x = plain_tensor(em, ins[0], "ArgMax's input")
    axis, keep, last = _argmax_attrs(at, x.rank)
    if not x.plain(axis):
        raise em.fail(f"ArgMax along axis {axis}, which holds the batch")
    groups = tuple((1,) if i == axis else g for i, g in enumerate(x.groups)) if keep else \
        tuple(g for i, g in enumerate(x.groups) if i != axis)
    return [em.tensor("argmax", [x], groups, axis=axis, keepdims=keep, select_last_index=last)]


# ---------------------------------------------------------------- along an axis


def _same_kind(em, data: Tensor, v) -> Tensor:
    t = em.as_tensor(v)
    if t.dtype != data.dtype:
        raise em.fail(f"updates are {t.dtype} but data is {data.dtype}")
    return t


def _int_indices(em, v, what="indices") -> Tensor:
    t = plain_tensor(em, v, what)
    if t.dtype != INT:
        raise em.fail(f"{what} must be integers")
    return t


def _reduction(em, at) -> str:
    reduction = at.get("reduction", "none")
    if reduction not in ("none", "add"):
        raise em.fail(f"reduction {reduction!r} on data is not supported (none and add are)")
    return reduction


def gather_elements(em, ins, at, n):
    data, idx = em.as_tensor(ins[0]), em.as_tensor(ins[1])
    axis = at.get("axis", 0) % data.rank
    if idx.rank != data.rank or any(g != h for i, (g, h) in enumerate(zip(data.groups, idx.groups)) if i != axis):
        # a batch merged with another dim is indexable where the indices merge it alike
        # (DeBERTa's (batch*heads, T, 2k) relative-position scores)
        data, idx = plain_tensor(em, data, "GatherElements' data"), plain_tensor(em, idx, "indices")
    if idx.dtype != INT:
        raise em.fail("indices must be integers")
    if not data.plain(axis) or not idx.plain(axis):
        raise em.fail(f"GatherElements along axis {axis}, which holds the batch")
    return [em.tensor("gather_elements", [data, idx], idx.groups, axis=_ir_axis(data, axis))]


def scatter_elements(em, ins, at, n):
    data = plain_tensor(em, ins[0], "ScatterElements' data")
    idx = _int_indices(em, ins[1])
    axis = at.get("axis", 0) % data.rank
    if not data.plain(axis):
        raise em.fail(f"ScatterElements along axis {axis}, which holds the batch")
    upd = _same_kind(em, data, ins[2])
    return [em.tensor("scatter_elements", [data, idx, upd], data.groups, axis=axis, reduction=_reduction(em, at))]


# ---------------------------------------------------------------- index tuples


def _per_sample(em, idx: Folded, data: Tensor):
    """Indices that depend on the batch size because their first entry numbers the samples
    (``arange(batch)`` along the indices' first dim, data's batch first): the rest of each
    tuple, as a tensor, for ``batch_dims=1``; None when the indices are not of that form."""
    if data.groups[0] != (None,):
        return None
    rest = []
    for t, batch in enumerate(TRACE_BATCHES):
        v = idx.at(t)
        if v.ndim < 2 or v.shape[0] != batch or v.shape[-1] < 1:
            return None
        samples = np.arange(batch).reshape((batch,) + (1,) * (v.ndim - 2))
        if not np.array_equal(v[..., 0], np.broadcast_to(samples, v.shape[:-1])):
            return None
        rest.append(v[..., 1:])
    first = rest[0][:1]
    if not all(np.array_equal(np.broadcast_to(first, r.shape), r) for r in rest):
        return None
    return Folded(rest[0], rest[1])


def _nd_indices(em, ins, data: Tensor):
    """(indices tensor, batch_dims) for GatherND / ScatterND's index tuples into ``data``."""
    idx = ins[1]
    batch_dims = 0
    if isinstance(idx, Folded) and not idx.const:
        rest = _per_sample(em, idx, data)
        if rest is not None:
            idx, batch_dims = rest, 1
    idx = _int_indices(em, idx)
    depth = dims_at(idx.groups[-1:], TRACE_BATCHES[0])[0]
    for k in range(batch_dims, batch_dims + depth):
        if k < data.rank and not data.plain(k):
            raise em.fail(f"index tuples address axis {k} of the data, which holds the batch")
    return idx, batch_dims, depth


def gather_nd(em, ins, at, n):
    data = plain_tensor(em, ins[0], "GatherND's data")
    if at.get("batch_dims", 0):
        idx = _int_indices(em, ins[1])
        b = at["batch_dims"]
        depth = dims_at(idx.groups[-1:], TRACE_BATCHES[0])[0]
    else:
        idx, b, depth = _nd_indices(em, ins, data)
    groups = idx.groups[:-1] + data.groups[b + depth:]
    return [em.tensor("gather_nd", [data, idx], groups, batch_dims=b)]


def scatter_nd(em, ins, at, n):
    data = plain_tensor(em, ins[0], "ScatterND's data")
    reduction = _reduction(em, at)
    idx, b, depth = _nd_indices(em, ins, data)
    upd = _same_kind(em, data, ins[2])
    if depth == 0:  # each sample's whole slice: the updates replace the data (or add to it)
        return [upd if reduction == "none" else em.broadcast_op("add", [data, upd])]
    upd = em.reshape(upd, single(upd.ir_shape))
    return [em.tensor("scatter_nd", [data, idx, upd], data.groups, batch_dims=b, reduction=reduction)]


# ---------------------------------------------------------------- NonZero: pooling at a token


class Hits:
    """NonZero's output on the way to a gather by index (see the module docstring): ``stage``
    is "nonzero" (2, n), "transposed" (n, 2), "rows" (n, ...: ``data`` at the hits) or
    "per_row" (batch, hits per row, ...); ``node`` names the NonZero."""

    __slots__ = ("mask", "stage", "data", "node")

    def __init__(self, mask: Tensor, stage: str, data: Tensor | None = None, node: str = ""):
        self.mask, self.stage, self.data, self.node = mask, stage, data, node

    def then(self, stage: str, data: Tensor | None = None) -> "Hits":
        return Hits(self.mask, stage, self.data if data is None else data, self.node)


def refuse_unpooled_outputs(graph, env: dict) -> None:
    """One error for a graph output that is NonZero's output, or a step of the pattern short of
    the pooling."""
    for o in graph.output:
        hits = env.get(o.name)
        if isinstance(hits, Hits):
            raise GraphError(f"ONNX node '{hits.node}' (NonZero): its output reaches the graph output "
                             f"{o.name!r} (at stage {hits.stage!r}); only pooling at one token per row, "
                             f"hidden[mask].view(batch, -1, dim)[:, k], is supported")


def nonzero(em, ins, at, n):
    x = em.as_tensor(ins[0])
    if x.rank != 2 or x.groups[0] != (None,) or not x.plain(1):
        raise em.fail(f"NonZero of a tensor of dims {x.groups}: its output size depends on the data; only "
                      f"a (batch, sequence) mask pooled per row (hidden[mask] -> one entry per row) is supported")
    return [Hits(as_mask(em, x), "nonzero", node=em.node)]


def _refuse(em, hits: Hits):
    return em.fail(f"reads NonZero's output (at stage {hits.stage!r}) outside the pattern the import "
                   f"supports: hidden[mask].view(batch, -1, dim)[:, k] (pooling at one token per row)")


def follow_hits(em, op_type: str, ins, at):
    """The next step of the NonZero pooling pattern for a node reading a ``Hits``."""
    hits = next(v for v in ins if isinstance(v, Hits))
    if op_type == "Identity":
        return [hits]
    if hits.stage == "nonzero" and op_type == "Transpose" and list(at.get("perm", [1, 0])) == [1, 0]:
        return [hits.then("transposed")]
    if hits.stage == "transposed" and op_type == "GatherND" and ins[1] is hits and not at.get("batch_dims", 0):
        data = plain_tensor(em, ins[0], "the pooled tensor")
        if data.rank < 2 or data.groups[0] != (None,) or data.groups[1] != hits.mask.groups[1]:
            raise em.fail(f"GatherND at a (batch, sequence) mask's hits from a tensor of dims {data.groups}")
        return [hits.then("rows", data)]
    if hits.stage == "rows" and op_type == "Reshape" and ins[0] is hits and isinstance(ins[1], Folded):
        rest = dims_at(hits.data.groups[2:], 1)
        for t, batch in enumerate(TRACE_BATCHES):
            target = tuple(int(d) for d in np.asarray(ins[1].at(t)).reshape(-1))
            if target[:2] != (batch, -1) or target[2:] != rest:
                raise em.fail(f"a reshape of the hits to {list(target)}: the pattern reshapes to (batch, -1, "
                              f"{', '.join(map(str, rest))})")
        return [hits.then("per_row")]
    if hits.stage == "per_row" and op_type == "Slice" and ins[0] is hits and _slices_everything(ins):
        return [hits]
    if hits.stage == "per_row" and op_type == "Gather" and ins[0] is hits and at.get("axis", 0) % hits.data.rank == 1:
        if not isinstance(ins[1], Folded) or np.ndim(ins[1].value) != 0:
            raise em.fail("the hit taken per row must be one constant index (x[:, k])")
        return [_pool_at_hit(em, hits, _const_int(em, ins[1], "the hit taken per row"))]
    raise _refuse(em, hits)


def _slices_everything(ins) -> bool:
    """Whether a Slice keeps every entry (dynamo writes ``x[:, -1]`` as a full slice of axis 0,
    then a Gather)."""
    args = (list(ins) + [None] * 5)[1:5]  # starts, ends, axes, steps
    if any(v is None for v in args[:2]) or not all(v is None or isinstance(v, Folded) and v.const for v in args):
        return False
    starts, ends = (np.asarray(v.value).reshape(-1) for v in args[:2])
    steps = np.ones_like(starts) if args[3] is None else np.asarray(args[3].value).reshape(-1)
    return bool((starts == 0).all() and (ends >= 2**31 - 1).all() and (steps == 1).all())


def _pool_at_hit(em, hits: Hits, which: int) -> Tensor:
    """``data[b, position of hit number which of row b]`` for each row b: a gather by index.
    The position of the r-th hit (1-based) is the number of positions whose running count of
    hits is below r, counted over all positions but the last: a row with too few hits (input
    against the model's contract) pools at its first (``which`` < 0) or last position, never out
    of its row."""
    mask, data = hits.mask, hits.data
    rows = ((None,), (1,))
    count = em.tensor("cumsum", [mask], mask.groups, axis=1)
    length = mask.groups[1][0]
    if which >= 0:
        rank = em.constant(np.asarray([[which + 1]], np.int64))
    else:  # from the end: the row's total count, less which's distance from it
        total = em.tensor("slice", [count], rows, axes=[1], starts=[length - 1], ends=[length])
        rank = em.broadcast_op("add", [total, Folded(np.asarray([[which + 1]], np.int64))])
    below = em.broadcast_op("compare", [count, rank], kind="less")
    if length == 1:  # the one position there is
        position = em.broadcast_op("mul", [em.tensor("slice", [below], rows, axes=[1], starts=[0], ends=[1]),
                                           Folded(np.zeros((1, 1), np.int64))])
    else:
        position = em.tensor("slice", [em.tensor("cumsum", [below], below.groups, axis=1)], rows,
                             axes=[1], starts=[length - 2], ends=[length - 1])
    return em.tensor("gather_nd", [data, position], data.groups[:1] + data.groups[2:], batch_dims=1)
