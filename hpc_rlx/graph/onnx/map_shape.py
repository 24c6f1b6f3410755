"""ONNX -> IR for shape ops: reshapes, transposes, joins, cuts, picks, broadcasts and
reductions (see ``map_math`` for the mapping convention).

Reshape-like ops compute the ONNX output shape at both trace batches (``TRACE_BATCHES``) and
let ``reshape_groups`` decide where the batch goes; shape inputs must be folded values.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.onnx import fold
from hpc_rlx.graph.onnx.emit import Tensor, dims_at, flat, reshape_groups, shape_group_error, single
from hpc_rlx.graph.onnx.fold import TRACE_BATCHES, Folded, FoldError, ints
from hpc_rlx.graph.shapes import FLOAT, INT


def _ir_axis(t: Tensor, axis: int) -> int:
    return sum(len(g) for g in t.groups[:axis])


def _folded(em, v, what: str) -> Folded:
    if not isinstance(v, Folded):
        raise em.fail(f"{what} must be computable without the data (a constant or shape arithmetic)")
    return v


def _regroup(em, x: Tensor, shape_of) -> Tensor:
    """Reshape ``x`` to ``shape_of(input dims, trace)`` (an ONNX shape rule)."""
    try:
        outs = [tuple(shape_of(dims_at(x.groups, b), t)) for t, b in enumerate(TRACE_BATCHES)]
        groups = reshape_groups(x.groups, *outs)
    except (ValueError, FoldError) as exc:
        raise em.fail(str(exc)) from None
    return em.reshape(x, groups)


def reshape(em, ins, at, n):
    target = _folded(em, ins[1], "Reshape's shape")
    allow = at.get("allowzero", 0)
    return [_regroup(em, em.as_tensor(ins[0]), lambda d, t: fold.reshape_shape(d, ints(target.at(t)), allow))]


def flatten(em, ins, at, n):
    return [_regroup(em, em.as_tensor(ins[0]), lambda d, t: fold.flatten_shape(d, at.get("axis", 1)))]


def _axes_input(em, ins, at):
    if len(ins) > 1 and ins[1] is not None:
        return ints(_folded(em, ins[1], "axes").value)
    return at.get("axes")


def squeeze(em, ins, at, n):
    axes = _axes_input(em, ins, at)
    return [_regroup(em, em.as_tensor(ins[0]), lambda d, t: fold.squeeze_shape(d, axes))]


def unsqueeze(em, ins, at, n):
    axes = _axes_input(em, ins, at)
    return [_regroup(em, em.as_tensor(ins[0]), lambda d, t: fold.unsqueeze_shape(d, axes))]


def transpose(em, ins, at, n):
    x = em.as_tensor(ins[0])
    perm = at.get("perm") or list(reversed(range(x.rank)))
    return [em.transpose(x, [p % x.rank for p in perm])]


def identity(em, ins, at, n):
    return [ins[0]]


def shape(em, ins, at, n):
    x = em.as_tensor(ins[0])
    cut = slice(at.get("start", 0), at.get("end"))
    return [Folded(*(np.asarray(dims_at(x.groups, b), np.int64)[cut] for b in TRACE_BATCHES))]


def size(em, ins, at, n):
    x = em.as_tensor(ins[0])
    return [Folded(*(np.asarray(np.prod(dims_at(x.groups, b)), np.int64) for b in TRACE_BATCHES))]


def concat(em, ins, at, n):
    parts = [em.as_tensor(v) for v in ins if v is not None and not (isinstance(v, Folded) and v.a.size == 0)]
    if len(parts) == 1:
        return parts
    axis = at["axis"] % parts[0].rank
    for p in parts:
        if p.rank != parts[0].rank or not p.plain(axis) or any(
                g != h for i, (g, h) in enumerate(zip(p.groups, parts[0].groups)) if i != axis):
            raise em.fail(f"Concat of {[str(flat(q.groups)) for q in parts]} along axis {axis}: the inputs must "
                          f"agree outside that axis, which must not hold the batch")
    total = sum(p.groups[axis][0] for p in parts)
    groups = parts[0].groups[:axis] + ((total,),) + parts[0].groups[axis + 1:]
    return [em.tensor("concat", parts, groups, axis=_ir_axis(parts[0], axis))]


def _cut(em, x: Tensor, cuts: list) -> Tensor:
    """IR slice of ``x`` by ``[(onnx axis, start, stop, step)]`` (already clamped)."""
    groups = list(x.groups)
    axes, starts, ends, steps = [], [], [], []
    for axis, start, stop, step in cuts:
        dim = x.groups[axis][0]
        groups[axis] = (len(range(start, stop, step)),)
        axes.append(_ir_axis(x, axis))
        starts.append(start)
        ends.append(stop if stop >= 0 else -dim - 1)  # a negative step that ran through index 0
        steps.append(step)
    if not axes:
        return x
    return em.tensor("slice", [x], groups, axes=axes, starts=starts, ends=ends, steps=steps)


def slice_(em, ins, at, n):
    x = em.as_tensor(ins[0])
    args = [None if v is None else _folded(em, v, "Slice's bounds") for v in (ins + [None] * 5)[1:5]]
    cuts = []
    per_trace = []
    for t in range(2):
        starts, ends = ints(args[0].at(t)), ints(args[1].at(t))
        axes = ints(args[2].at(t)) if args[2] is not None else list(range(len(starts)))
        steps = ints(args[3].at(t)) if args[3] is not None else [1] * len(starts)
        dims = dims_at(x.groups, TRACE_BATCHES[t])
        per_trace.append([(a % x.rank, *slice(s, e, st).indices(dims[a % x.rank]))
                          for a, s, e, st in zip(axes, starts, ends, steps)])
    for (axis, *ra), (_, *rb) in zip(*per_trace):
        dims = [dims_at(x.groups, b)[axis] for b in TRACE_BATCHES]
        if all(tuple(r) == (0, d, 1) for r, d in zip((ra, rb), dims)):
            continue  # the whole axis
        if not x.plain(axis) or ra != rb:
            raise em.fail(f"a slice of axis {axis}, which holds the batch: " + shape_group_error("it"))
        cuts.append((axis, *ra))
    return [_cut(em, x, cuts)]


def split(em, ins, at, n):
    x = em.as_tensor(ins[0])
    axis = at.get("axis", 0) % x.rank
    if not x.plain(axis):
        raise em.fail(f"Split along axis {axis}, which holds the batch")
    sizes_in = None if len(ins) < 2 or ins[1] is None else _folded(em, ins[1], "Split's sizes").value
    sizes = fold.split_sizes([None, sizes_in], {**at, "_outputs": n}, x.groups[axis][0])
    outs, start = [], 0
    for size_ in sizes:
        outs.append(_cut(em, x, [(axis, start, start + size_, 1)]))
        start += size_
    return outs


class TensorSequence(tuple):
    """An ONNX sequence value (SplitToSequence's output): the pieces, read by SequenceAt."""


def split_to_sequence(em, ins, at, n):
    """The pieces of a split as one sequence value: dynamo writes ``torch.split`` this way."""
    x = em.as_tensor(ins[0])
    axis = at.get("axis", 0) % x.rank
    if not x.plain(axis):
        raise em.fail(f"SplitToSequence along axis {axis}, which holds the batch")
    dim = x.groups[axis][0]
    if len(ins) < 2 or ins[1] is None:
        if at.get("keepdims", 1) == 0:
            raise em.fail("SplitToSequence without split sizes and keepdims=0 is not supported")
        sizes = [1] * dim
    else:
        split = np.asarray(_folded(em, ins[1], "SplitToSequence's sizes").value, np.int64)
        if split.ndim == 0:        # one size: equal pieces, the last one smaller
            k = int(split)
            sizes = [min(k, dim - i) for i in range(0, dim, k)]
        else:
            sizes = [int(v) for v in split]
    pieces, start = [], 0
    for size_ in sizes:
        pieces.append(_cut(em, x, [(axis, start, start + size_, 1)]))
        start += size_
    return [TensorSequence(pieces)]


def sequence_at(em, ins, at, n):
    seq = ins[0]
    if not isinstance(seq, TensorSequence):
        raise em.fail("SequenceAt reads a sequence that is not a SplitToSequence output")
    position = int(np.asarray(_folded(em, ins[1], "SequenceAt's position").value).reshape(()))
    return [seq[position]]


def _is_contiguous_view(data: Tensor, idx: Folded, axis: int) -> bool:
    """Whether gathering ``idx`` from a 1-D ``data`` reads every element once, in order, at
    both trace batches: dynamo writes ``Tensor.as_strided`` that way (the flattened tensor
    gathered at offsets it computes from the batch size), and where the strides are the
    contiguous ones (torch 2.14's adaptive average pooling, restriding its 1x1 output), the
    gather is a reshape to the index's shape."""
    if data.rank != 1 or axis != 0:
        return False
    for t, b in enumerate(TRACE_BATCHES):
        v = np.asarray(idx.at(t))
        if v.size != dims_at(data.groups, b)[0] or not np.array_equal(v.reshape(-1), np.arange(v.size)):
            return False
    return True


def gather(em, ins, at, n):
    data, idx = ins
    if isinstance(idx, Folded) and not idx.const and isinstance(data, Tensor) \
            and _is_contiguous_view(data, idx, at.get("axis", 0) % data.rank):
        return [_regroup(em, data, lambda d, t: tuple(idx.at(t).shape))]
    if isinstance(idx, Folded) and not idx.const:
        # indices that vary only by being broadcast to the batch (BERT's token type ids: zeros
        # expanded to (batch, seq)): a constant broadcast at run time, then as token ids
        idx = em.as_tensor(idx)
    if isinstance(idx, Tensor):  # indices computed from the data: token ids
        if idx.dtype != INT:
            raise em.fail("Gather indices must be integers")
        data = em.as_tensor(data)
        axis = at.get("axis", 0) % data.rank
        if data.batch_axis is not None:
            raise em.fail("Gather from a tensor holding the batch with data-dependent indices")
        groups = data.groups[:axis] + idx.groups + data.groups[axis + 1:]
        if axis == 0 and data.rank == 2:
            return [em.tensor("embedding", [idx, data], groups)]
        return [em.tensor("gather", [data, idx], groups, axis=_ir_axis(data, axis))]
    data = em.as_tensor(data)
    axis = at.get("axis", 0) % data.rank
    if not data.plain(axis):
        raise em.fail(f"Gather along axis {axis}, which holds the batch")
    iv = np.asarray(idx.value, np.int64)
    groups = data.groups[:axis] + single(iv.shape) + data.groups[axis + 1:]
    return [em.tensor("gather", [data, em.constant(iv)], groups, axis=_ir_axis(data, axis))]


def _expand_error(x: Tensor, target: Folded, exc: ValueError) -> str:
    """Why an Expand does not broadcast at the trace batches. The usual cause: a fixed dim of x
    where the target has the batch, the batch size the model was exported at written into it as
    a constant (TorchScript's ``t[:, 0] = vector``), a model ONNX Runtime also runs only at that
    batch size."""
    shape, want = dims_at(x.groups, TRACE_BATCHES[0]), tuple(ints(target.at(0)))
    varies = [a != b for a, b in zip(want, ints(target.at(1)))]
    fixed = [d for d, v in zip(shape[::-1], varies[::-1]) if v and d != 1 and d != TRACE_BATCHES[0]]
    if not fixed:
        return str(exc)
    return (f"Expand of a tensor of dims {list(shape)} to a shape with the batch ({list(want)}, both at "
            f"batch {TRACE_BATCHES[0]}): the model fixes its batch size at {fixed[0]}, "
            f"the size it was exported at (ONNX Runtime runs it at no other); export it with the "
            f"expansion written against the batch (e.g. value.expand_as(target) before an indexed write)")


def expand(em, ins, at, n):
    x = em.as_tensor(ins[0])
    target = _folded(em, ins[1], "Expand's shape")
    try:
        outs = [np.broadcast_shapes(dims_at(x.groups, b), tuple(ints(target.at(t))))
                for t, b in enumerate(TRACE_BATCHES)]
    except ValueError as exc:
        raise em.fail(_expand_error(x, target, exc)) from None
    pad = len(outs[0]) - x.rank
    groups, new_batch = [], False
    for i, (a, b) in enumerate(zip(*outs)):
        own = x.groups[i - pad] if i >= pad else None
        if own is not None and dims_at((own,), TRACE_BATCHES[0]) == (a,) and dims_at((own,), TRACE_BATCHES[1]) == (b,):
            groups.append(own)
        elif a != b:
            if (a, b) != TRACE_BATCHES:
                raise em.fail(shape_group_error(f"Expand to a multiple of the batch ({a} at batch {TRACE_BATCHES[0]})"))
            groups.append((None,))
            new_batch = True
        else:
            groups.append((a,))
    # a dim that merges the batch with another may stay as it is (F.normalize expands a norm
    # over the last axis of Swin V2's (B*windows, heads, N, d) queries), not be broadcast
    if any(len(g) > 1 and (i < pad or g != x.groups[i - pad]) for i, g in enumerate(groups)):
        raise em.fail("Expand of a tensor whose dims merge the batch with another")
    no_batch = tuple((1,) if g == (None,) and (i < pad or x.groups[i - pad] != (None,)) else g
                     for i, g in enumerate(groups))
    y = x
    if flat(no_batch) != x.ir_shape:
        y = em.tensor("expand", [x], no_batch, shape=list(flat(no_batch)))
    return [em.with_batch(y, tuple(groups)) if new_batch else y]


def tile(em, ins, at, n):
    """ONNX Tile on data: an axis's copies become an IR dim of their own in front of the
    axis's IR dims (the ONNX dim is their product, as a reshape would merge them), broadcast,
    so the gradient sums the copies. A count may be the batch size: DeBERTa repeats its
    relative-position keys per sample, (heads, ...) to (batch*heads, ...)."""
    x = em.as_tensor(ins[0])
    reps = _folded(em, ins[1], "Tile's repeats")
    counts = [ints(reps.at(t)) for t in range(len(TRACE_BATCHES))]
    if len(counts[0]) != x.rank:
        raise em.fail(f"Tile's repeats {counts[0]} do not match its input's rank {x.rank}")
    ones, fixed, groups = [], [], []    # the input's groups with the copies' dims: 1, constant, batch
    by_batch = False
    for g, r1, r2 in zip(x.groups, *counts):
        if r1 == r2 == 1:
            copies = ()
        elif r1 == r2 and r1 > 1:
            copies = (r1,)
        elif (r1, r2) == TRACE_BATCHES and x.batch_axis is None and not by_batch:
            copies, by_batch = (None,), True
        else:
            raise em.fail(f"Tile by {_sym(counts)}: each count must be a constant of at least 1, or the "
                          f"batch size once on an input without the batch")
        ones.append((1,) * len(copies) + g)
        fixed.append(tuple(1 if c is None else c for c in copies) + g)
        groups.append(copies + g)
    y = em.reshape(x, tuple(ones))
    if flat(fixed) != y.ir_shape:
        y = em.tensor("expand", [y], tuple(fixed), shape=list(flat(fixed)))
    groups = tuple(groups)
    if groups == tuple(fixed):
        return [y]
    # IR broadcasting dim by dim against zeros with the batch (ONNX's would see B*k against k)
    zeros = em.batch_zeros(groups)
    if y.dtype == FLOAT:
        return [em.tensor("add", [y, zeros], groups)]
    as_float = em.tensor("cast", [y], y.groups, to=FLOAT)
    return [em.tensor("cast", [em.tensor("add", [as_float, zeros], groups)], groups, to=INT)]


def _sym(counts) -> str:
    """Tile's counts, those that vary with the batch size written as multiples of it."""
    b1, b2 = TRACE_BATCHES

    def one(a, b):
        if a == b:
            return a
        k = a // b1
        return ("batch" if k == 1 else f"{k}*batch") if a == k * b1 and b == k * b2 else "varies"
    return str([one(a, b) for a, b in zip(*counts)])


def reduce(op: str, square: bool = False, root: bool = False):
    """A Reduce* node as IR ``op`` over its axes; ``square``: of the squares (ReduceSumSquare),
    ``root``: then the square root (ReduceL2, torch.linalg.vector_norm and F.normalize)."""
    def emit(em, ins, at, n):
        x = em.as_tensor(ins[0])
        if square:
            x = em.tensor("mul", [x, x], x.groups)
        axes_in = None if len(ins) < 2 or ins[1] is None else _folded(em, ins[1], "axes").value
        axes = fold.reduce_axes([None, axes_in], at, x.rank)
        if axes == ():
            return [x]
        axes = set(range(x.rank)) if axes is None else set(axes)
        keep = bool(at.get("keepdims", 1))
        ir_axes = [_ir_axis(x, a) + k for a in sorted(axes) for k in range(len(x.groups[a]))]
        groups = tuple((1,) * len(g) if i in axes else g for i, g in enumerate(x.groups) if keep or i not in axes)
        out = em.tensor(op, [x], groups, axes=ir_axes, keepdims=keep)
        return [em.tensor("sqrt", [out], groups) if root else out]

    return emit
