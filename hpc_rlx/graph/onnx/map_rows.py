"""ONNX -> IR for a pick of one entry per row by a run-time index, ``logits[arange(batch), idx]``:
how both exporters write the pooling of a decoder-only sequence classifier at its last
non-padding token (transformers' ``*ForSequenceClassification`` for Llama, Mistral, Qwen2, ...;
``idx`` is an ArgMax over the token ids' mask):

- dynamo: ``GatherND(logits, Concat(Unsqueeze(arange(batch)), Unsqueeze(idx)))``, the two index
  parts broadcast to the shape of ``Max(arange(batch), idx)``;
- TorchScript: ``Gather(Flatten(logits) to (batch*T, C), arange(batch)*T + idx)``.

The sample numbers ``arange(batch)`` are known without the data at each trace batch (a
``Folded`` that varies with it), but they have no IR value: an index never addresses the batch
dim, each lane holds a slice of it. Where they meet a run-time tensor (``meet``), the value
becomes one of the markers below, and the gather it leads to indexes per sample
(``batch_dims=1``) with the run-time part. A marker read by any other node is refused, naming
that node (``follow``). The same is done for NonZero's pooling (``map_index.Hits``).
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.onnx import map_index as ix
from hpc_rlx.graph.onnx import map_shape
from hpc_rlx.graph.onnx.emit import Tensor, dims_at, single
from hpc_rlx.graph.onnx.fold import TRACE_BATCHES, Folded
from hpc_rlx.graph.shapes import INT


class SampleIndex:
    """A value built from the sample numbers and run-time indices ``rest``; ``groups``: its ONNX
    dims (what Shape reads)."""

    __slots__ = ("rest", "groups", "stride")

    def __init__(self, rest, groups, stride: int = 1):
        self.rest, self.groups, self.stride = rest, tuple(groups), stride


class Tuples(SampleIndex):
    """Index tuples along the last axis whose first entry is the sample's number: the rest of
    each tuple is ``rest``."""


class Offsets(SampleIndex):
    """Flat positions ``sample * stride + rest`` into a dim that merges the batch (outer) with
    ``stride`` rows per sample."""


class ShapeOnly(SampleIndex):
    """A value computed from the sample numbers and data of which only the shape may be read."""


MARKERS = (ix.Hits, SampleIndex)


def sample_stride(v) -> int | None:
    """k when ``v`` is ``k * arange(batch)`` along its first axis (broadcast along the others) at
    both trace batches, for one integer k >= 1; else None."""
    if not isinstance(v, Folded) or v.const:
        return None
    strides = set()
    for t, batch in enumerate(TRACE_BATCHES):
        a = np.asarray(v.at(t))
        if a.ndim < 1 or a.shape[0] != batch or a.dtype.kind not in "iu" or batch < 2:
            return None
        k = int(a.reshape(batch, -1)[1, 0] - a.reshape(batch, -1)[0, 0])
        rows = (k * np.arange(batch)).reshape((batch,) + (1,) * (a.ndim - 1))
        if k < 1 or not np.array_equal(a, np.broadcast_to(rows, a.shape)):
            return None
        strides.add(k)
    return strides.pop() if len(strides) == 1 else None


def _groups(v) -> tuple:
    if isinstance(v, Tensor):
        return v.groups
    return ((None,),) + single(np.shape(v.at(0))[1:])


def meet(em, op_type: str, ins, at):
    """The marker for a node that combines the sample numbers with a run-time tensor in one of
    the patterns above; None for any other node (the import goes on as without this module)."""
    present = [v for v in ins if v is not None]
    tensors = [v for v in present if isinstance(v, Tensor)]
    numbers = [v for v in present if sample_stride(v) is not None]
    if not tensors or not numbers or any(isinstance(v, Folded) and not v.const and v not in numbers
                                         for v in present):
        return None
    if any(t.dtype != INT for t in tensors):
        return None
    if op_type in ("Max", "Min") and all(sample_stride(v) == 1 for v in numbers):
        return [ShapeOnly(None, em.broadcast_groups([_groups(v) for v in present]))]
    if op_type == "Add" and len(present) == 2 and len(tensors) == 1 and tensors[0].groups == ((None,),) \
            and np.ndim(numbers[0].at(0)) == 1:
        return [Offsets(tensors[0], tensors[0].groups, sample_stride(numbers[0]))]
    if op_type == "Concat" and present[0] is numbers[0] and len(numbers) == 1 and sample_stride(numbers[0]) == 1:
        first = np.asarray(numbers[0].at(0))
        if at.get("axis") % first.ndim != first.ndim - 1 or first.shape[-1] != 1:
            return None
        rest = map_shape.concat(em, present[1:], at, 1)[0]
        if rest.dtype != INT or rest.groups[:-1] != _groups(numbers[0])[:-1]:
            return None
        depth = dims_at(rest.groups[-1:], TRACE_BATCHES[0])[0]
        return [Tuples(rest, rest.groups[:-1] + ((depth + 1,),))]
    return None


def follow(em, op_type: str, ins, at):
    """The next step for a node that reads a marker: the gather it leads to, its shape, or one
    error naming the node."""
    if any(isinstance(v, ix.Hits) for v in ins):
        return ix.follow_hits(em, op_type, ins, at)
    mark = next(v for v in ins if isinstance(v, SampleIndex))
    if op_type == "Identity":
        return [mark]
    if op_type == "Shape":
        cut = slice(at.get("start", 0), at.get("end"))
        return [Folded(*(np.asarray(dims_at(mark.groups, b), np.int64)[cut] for b in TRACE_BATCHES))]
    if op_type == "GatherND" and isinstance(mark, Tuples) and ins[1] is mark and not at.get("batch_dims", 0):
        return [_gather_tuples(em, ins[0], mark)]
    if op_type == "Gather" and isinstance(mark, Offsets) and ins[1] is mark and at.get("axis", 0) == 0:
        return [_gather_offsets(em, em.as_tensor(ins[0]), mark)]
    raise em.fail("reads the sample numbers (arange over the batch) outside the per-row pick the import "
                  "supports: logits[arange(batch), index] (a gather of one entry per row)")


def _gather_tuples(em, data, mark: Tuples) -> Tensor:
    data = ix.plain_tensor(em, data, "GatherND's data")
    depth = mark.groups[-1][0] - 1
    if data.groups[0] != (None,) or data.rank < depth + 1 or not all(data.plain(k) for k in range(1, depth + 1)):
        raise em.fail(f"GatherND per sample from data of dims {data.groups}: the batch must be its first dim alone")
    groups = mark.rest.groups[:-1] + data.groups[depth + 1:]
    return em.tensor("gather_nd", [data, mark.rest], groups, batch_dims=1)


def _gather_offsets(em, data: Tensor, mark: Offsets) -> Tensor:
    if data.groups[0] != (None, mark.stride) or mark.rest.groups != ((None,),):
        raise em.fail(f"Gather at sample * {mark.stride} + index from data of dims {data.groups}: the first dim "
                      f"must merge the batch with {mark.stride} rows per sample")
    rows = Tensor(data.name, ((None,), (mark.stride,)) + data.groups[1:], data.dtype)
    idx = em.reshape(mark.rest, ((None,), (1,)))
    return em.tensor("gather_nd", [rows, idx], ((None,),) + data.groups[1:], batch_dims=1)
