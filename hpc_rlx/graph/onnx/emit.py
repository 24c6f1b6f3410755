"""The IR side of the ONNX importer: tensors with their ONNX dims, and the ``Emitter`` that
writes IR nodes, constants and parameters.

An ONNX tensor whose shape mixes the batch into another dimension (``(T, B*H, D)`` inside
PyTorch's multi-head attention) has no IR shape of its own: the IR has one batch symbol, and
only as a whole dimension. Such a tensor is kept as an IR tensor with the batch split out
(``(T, B, H, D)``) and *groups*: each ONNX dimension is a run of consecutive IR dimensions
(``((T,), (None, H), (D,))``). Most tensors have one IR dimension per ONNX dimension.
"""

from __future__ import annotations

import math
import re

import numpy as np

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.builder import GraphBuilder
from hpc_rlx.graph.onnx.fold import TRACE_BATCHES, Folded
from hpc_rlx.graph.onnx.scopes import module_of
from hpc_rlx.graph.shapes import FLOAT, INT, fmt_shape

FLOAT32_MAX = float(np.finfo(np.float32).max)
SHORT_DECIMALS = 4096  # float32 constants up to this size are written as their shortest decimals
_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")


# constants exporters write that float32 cannot hold, by their float32 value: exact GELU divides
# by sqrt(2); hard sigmoid and hard swish divide by 6 (ONNX HardSigmoid's alpha); attention
# scales its scores by head_dim ** -0.5
_IRRATIONAL = {np.float32(v): v for v in (math.sqrt(2), 1 / math.sqrt(2), math.sqrt(2 / math.pi), math.pi,
                                          1 / 6, 1 / 3)}
# d ** -0.25: attention's scale split over the query and the key (dynamo's sqrt of 1/sqrt(head dim))
_IRRATIONAL.update({np.float32(v): v for d in range(2, 1025) for v in (d ** -0.5, d ** 0.5, d ** -0.25)
                    if np.float32(v) not in _IRRATIONAL and float(np.float32(v)) != v})


def decimal32(x: float) -> float:
    """The number a float32 constant stands for: the shortest decimal with that float32 value
    (1e-05 for 9.99999974738e-06), or sqrt(2) and the like. Float32 files round PyTorch's
    constants, and a float64 run should see the constants the model was written with."""
    f = np.float32(x)
    return _IRRATIONAL.get(f) or float(np.format_float_scientific(f, unique=True))


def sanitise(name: str) -> str:
    """An IR name (letters, digits, '_', '.', '-'; not starting with '.' or '-')."""
    out = _BAD_CHARS.sub("_", name) or "_"
    if out[0] in ".-":
        out = "_" + out
    return out[:120]


def flat(groups) -> tuple:
    return tuple(d for g in groups for d in g)


def dims_at(groups, batch: int) -> tuple:
    """The ONNX shape of grouped dims when the batch is ``batch``."""
    return tuple(math.prod(batch if d is None else d for d in g) for g in groups)


def single(shape) -> tuple:
    return tuple((d,) for d in shape)


class Tensor:
    """An ONNX value held by an IR node, input or parameter ``name``; ``transpose_of`` is the
    2-D tensor this one transposes (linear can then read it in PyTorch's layout)."""

    __slots__ = ("name", "groups", "dtype", "transpose_of")

    def __init__(self, name: str, groups, dtype: str = FLOAT, transpose_of=None):
        self.name, self.groups, self.dtype = name, tuple(tuple(g) for g in groups), dtype
        self.transpose_of = transpose_of

    @property
    def ir_shape(self) -> tuple:
        return flat(self.groups)

    @property
    def rank(self) -> int:
        return len(self.groups)

    @property
    def batch_axis(self):
        """The ONNX axis holding the batch, or None."""
        return next((i for i, g in enumerate(self.groups) if None in g), None)

    def plain(self, axis: int) -> bool:
        """Whether ONNX ``axis`` is one IR dimension that is not the batch."""
        g = self.groups[axis]
        return len(g) == 1 and g[0] is not None

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.groups}, {self.dtype})"


def shape_group_error(what: str) -> str:
    return f"dynamic shape {what} cannot be made static"


def reshape_groups(groups, out_a, out_b) -> tuple:
    """The groups of a reshape of ``groups`` to ONNX shape ``out_a`` / ``out_b`` (at the two
    trace batches). The batch must stay a whole block of samples: ``(T, B, D) -> (T*B, D)`` is
    fine, ``(B, 4) -> (2, 2*B)`` mixes samples and is refused."""
    b1, b2 = TRACE_BATCHES
    if len(out_a) != len(out_b):
        raise ValueError(shape_group_error(f"{list(out_a)}"))
    if 0 in out_a:
        raise ValueError(f"a reshape to an empty shape {list(out_a)} is not supported")
    varying = [i for i, (a, b) in enumerate(zip(out_a, out_b)) if a != b]
    src = flat(groups)
    if not varying:
        if None in src:
            raise ValueError(f"the batch dim of {fmt_shape(src)} disappears in the reshape to {list(out_a)}")
        return single(out_a)
    q = varying[0]
    k, rest = divmod(out_a[q], b1)
    if len(varying) > 1 or None not in src or rest or out_b[q] != k * b2:
        raise ValueError(shape_group_error(f"{_sym(out_a, out_b)} (from {fmt_shape(src)})"))
    p = src.index(None)
    before, after = math.prod(src[:p]), math.prod(src[p + 1:])
    q_before, q_after = math.prod(out_a[:q]), math.prod(out_a[q + 1:])
    if before % q_before or after % q_after:
        raise ValueError(f"reshape of {fmt_shape(src)} to {_sym(out_a, out_b)} mixes samples of the batch: "
                         + shape_group_error("it"))
    k1, k2 = before // q_before, after // q_after
    g = ((k1,) if k1 > 1 else ()) + (None,) + ((k2,) if k2 > 1 else ())
    return single(out_a[:q]) + (g,) + single(out_a[q + 1:])


def _sym(out_a, out_b) -> str:
    """A shape with its batch-dependent entries written as multiples of B."""
    b1 = TRACE_BATCHES[0]
    return "[" + ", ".join(str(a) if a == b else (f"{a // b1}*B" if a % b1 == 0 else "?")
                           for a, b in zip(out_a, out_b)) + "]"


class Emitter:
    """Writes the IR graph for one import: ``op`` appends a node named after the ONNX node
    being translated (``at``), ``constant`` / ``param`` add leaves, and the helpers reshape
    or broadcast tensors into the forms IR ops take."""

    def __init__(self, name: str):
        self.b = GraphBuilder(name)
        self.used: set[str] = {"x", "y"}  # the data inputs, named before the loss head adds y
        self.node, self.op_type, self.base = "", "", "n"
        self._consts: dict = {}
        self._zeros = None
        self.data_input: Tensor | None = None
        self.proto = None  # the NodeProto being translated (handlers read its metadata)
        self.opset = 0
        # what the training forms found: batch norms on batch / running statistics, dropouts on / off
        self.forms: dict[str, list] = {"bn_train": [], "bn_frozen": [], "dropout": [], "dropout_off": []}
        # IR names of uniform draws -> (the tensor giving their shape, low, high): a comparison
        # of one with a constant is a random mask (map_random)
        self.uniform_draws: dict[str, tuple] = {}
        # ONNX tensors that are random draws -> their value at inference (their expectation, one
        # number everywhere): the exporter writes them so (graph.meta["onnx"]["expectations"])
        self.expectations: dict[str, float] = {}
        self.output_name = ""   # the ONNX name of the first output of the node being translated

    # ------------------------------------------------------------------ naming and errors

    def at(self, node_name: str, op_type: str, first_output: str) -> None:
        self.node, self.op_type, self.output_name = node_name, op_type, first_output
        self.base = sanitise(first_output or node_name or op_type)

    def fail(self, msg: str) -> GraphError:
        module = module_of(self.proto) if self.proto is not None else None
        where = f" in {module}" if module else ""
        err = GraphError(f"ONNX node '{self.node}' ({self.op_type}){where}: {msg}")
        err.reason = msg    # without the node: the import's one error groups nodes by it
        return err

    def unique(self, name: str) -> str:
        name = sanitise(name)
        out, k = name, 1
        while out in self.used:
            k += 1
            out = f"{name}_{k}"
        self.used.add(out)
        return out

    # ------------------------------------------------------------------ leaves

    def input(self, name: str, shape, dtype: str) -> Tensor:
        self.used.add(name)
        self.b.input(name, shape, dtype)
        return Tensor(name, single(shape), dtype)

    def param(self, name: str, value: np.ndarray, trainable: bool = True, init: dict | None = None) -> Tensor:
        if init is None:
            init = {"scheme": "fan_in_uniform"} if value.ndim >= 2 else {"scheme": "zeros"}
        self.used.add(name)
        self.b.param(name, list(value.shape), init, trainable=trainable)
        return Tensor(name, single(value.shape))

    def constant(self, value) -> Tensor:
        """An IR constant node (cached): floats in the compute dtype, integers and booleans int64."""
        value = np.asarray(value)
        is_float = value.dtype.kind == "f"
        if is_float:
            if np.isnan(value).any():
                raise self.fail("a constant holds NaN")
            short = value.dtype == np.float32 and value.size <= SHORT_DECIMALS
            value = np.clip(value.astype(np.float64), -FLOAT32_MAX, FLOAT32_MAX)  # -inf masks stay "very negative"
            if short:
                value = np.vectorize(decimal32, otypes=[np.float64])(value).reshape(value.shape)
        else:
            value = value.astype(np.int64)
        key = (is_float, value.shape, value.tobytes())
        if key not in self._consts:
            name = self.b.op("constant", name=self.unique(f"{self.base}.const"), value=value.tolist(),
                             dtype=FLOAT if is_float else INT, shape=list(value.shape))
            self._consts[key] = name
        return Tensor(self._consts[key], single(value.shape), FLOAT if is_float else INT)

    # ------------------------------------------------------------------ nodes

    def op(self, op: str, *inputs: str, **attrs) -> str:
        name = self.unique(self.base if self.base not in self.used else f"{self.base}.{op}")
        try:
            return self.b.op(op, *inputs, name=name, **attrs)
        except GraphError as exc:
            raise self.fail(str(exc)) from None

    def tensor(self, op: str, inputs, groups, /, **attrs) -> Tensor:
        """A node whose output holds ONNX dims ``groups``; its IR shape must agree."""
        name = self.op(op, *[t.name if isinstance(t, Tensor) else t for t in inputs], **attrs)
        t = self.b.type_of(name)
        if t.shape != flat(groups):
            raise self.fail(f"the importer expected shape {fmt_shape(flat(groups))} from IR op '{op}', "
                            f"which gives {fmt_shape(t.shape)}")
        return Tensor(name, groups, t.dtype)

    def transpose(self, t: Tensor, perm) -> Tensor:
        """ONNX Transpose: permutes the groups."""
        starts = np.cumsum([0] + [len(g) for g in t.groups])
        axes = [int(a) for p in perm for a in range(starts[p], starts[p + 1])]
        groups = tuple(t.groups[p] for p in perm)
        if axes == list(range(len(axes))):
            return Tensor(t.name, groups, t.dtype)
        out = self.tensor("transpose", [t], groups, axes=axes)
        if t.rank == 2 and list(perm) == [1, 0] and t.batch_axis is None:
            out.transpose_of = t
        return out

    def reshape(self, t: Tensor, groups) -> Tensor:
        """``t`` with new groups; IR reshape only takes the batch first, so a batch elsewhere
        goes to the front for the reshape and back afterwards."""
        src, dst = t.ir_shape, flat(groups)
        if src == dst:
            return Tensor(t.name, groups, t.dtype, t.transpose_of)
        if None not in src:
            return self.tensor("reshape", [t], groups, shape=list(dst))
        p, q = src.index(None), dst.index(None)
        cur = t
        if p:
            order = [p] + [i for i in range(len(src)) if i != p]
            cur = self.tensor("transpose", [cur], single(tuple(src[i] for i in order)), axes=order)
        mid = (None,) + dst[:q] + dst[q + 1:]
        if cur.ir_shape != mid:
            cur = self.tensor("reshape", [cur], single(mid), shape=list(mid))
        if q:
            order = list(range(1, q + 1)) + [0] + list(range(q + 1, len(dst)))
            cur = self.tensor("transpose", [cur], single(dst), axes=order)
        return Tensor(cur.name, groups, cur.dtype)

    def batch_zeros(self, groups) -> Tensor:
        """Float zeros with the batch where ``groups`` has it and 1 elsewhere: broadcasting
        against it gives a tensor a batch dim it did not have (the IR's expand needs one)."""
        if self._zeros is None:
            x = self.data_input
            cur = x.name
            if x.rank > 1:
                axes = list(range(1, x.rank))
                cur = self.op("slice", cur, axes=axes, starts=[0] * len(axes), ends=[1] * len(axes))
                cur = self.op("reshape", cur, shape=[None])
            zero = self.constant(np.zeros((), np.float32)).name
            # where() reads its condition as nonzero-or-not: zeros even for inf or NaN inputs
            self._zeros = Tensor(self.op("where", cur, zero, zero), ((None,),))
        ones = tuple(tuple(1 if d is not None else None for d in g) for g in groups)
        return self.reshape(Tensor(self._zeros.name, ((None,),)), ones)

    def with_batch(self, t: Tensor, groups) -> Tensor:
        """``t`` broadcast to ``groups``, which hold the batch where ``t`` has size 1."""
        zeros = self.batch_zeros(groups)
        if t.dtype == FLOAT:
            return self.broadcast_op("add", [t, zeros])
        as_float = self.tensor("cast", [t], t.groups, to=FLOAT)
        return self.tensor("cast", [self.broadcast_op("add", [as_float, zeros])], groups, to=INT)

    # ------------------------------------------------------------------ values

    def as_tensor(self, v) -> Tensor:
        """A Tensor for a folded value: a constant, or for one that depends on the batch size
        only through a batch dim it is constant along, that constant broadcast to the batch."""
        if isinstance(v, Tensor):
            return v
        if v.const:
            return self.constant(v.value)
        a, b = v.a, v.b
        b1, b2 = TRACE_BATCHES
        axes = [i for i in range(a.ndim) if a.shape[i] != b.shape[i]] if a.ndim == b.ndim else None
        # the varying dim is the batch, or k samples' rows per sample (k*B: a stochastic-depth
        # mask drawn per row of MobileViT's (B*patches, N, C) tokens)
        k = a.shape[axes[0]] // b1 if axes and len(axes) == 1 else 0
        if not k or a.shape[axes[0]] != k * b1 or b.shape[axes[0]] != k * b2:
            raise self.fail(shape_group_error(f"value {a.tolist() if a.size <= 8 else a.shape}"))
        ax = axes[0]
        first = np.take(a, [0], axis=ax)
        if not (np.array_equal(np.broadcast_to(first, a.shape), a)
                and np.array_equal(np.broadcast_to(first, b.shape), b)):
            raise self.fail(shape_group_error("(a value that varies along the batch)"))
        if k == 1:
            c = self.constant(first)
            return self.with_batch(c, tuple((None,) if i == ax else g for i, g in enumerate(c.groups)))
        # constant along the dim, so the samples' order in it does not change the value: the
        # batch outermost, as a reshape of (B, k, ...) to (B*k, ...) writes it
        c = self.constant(np.expand_dims(np.repeat(first, k, axis=ax), ax))
        groups = tuple((None, k) if i == ax else g for i, g in enumerate(single(first.shape)))
        # IR broadcasting, dim by dim: ONNX's would see one merged dim of k against B
        zeros = self.batch_zeros(groups)
        if c.dtype == FLOAT:
            return self.tensor("add", [c, zeros], groups)
        as_float = self.tensor("cast", [c], single(c.ir_shape), to=FLOAT)
        return self.tensor("cast", [self.tensor("add", [as_float, zeros], groups)], groups, to=INT)

    def broadcast_op(self, op: str, values, **attrs) -> Tensor:
        """An elementwise IR op over ONNX-broadcast operands (Tensors or Folded)."""
        values = [v if isinstance(v, Tensor) or v.const else self.as_tensor(v) for v in values]
        groups_of = [groups_of_value(v) for v in values]
        out = self.broadcast_groups(groups_of)
        return self.tensor(op, [self.fit(v, out) for v in values], out, **attrs)

    def broadcast_groups(self, groups_of) -> tuple:
        """ONNX (NumPy) broadcasting of grouped shapes: a dim of size 1 takes the other's group."""
        rank = max(len(g) for g in groups_of)
        out = []
        for k in range(1, rank + 1):
            gs = [g[-k] for g in groups_of if len(g) >= k]
            real = [g for g in gs if dims_at((g,), 2) != (1,)]
            if real and any(g != real[0] for g in real):
                raise self.fail(f"operands do not broadcast: {[fmt_shape(flat(g)) for g in groups_of]}")
            out.append(real[0] if real else (1,) * max(len(g) for g in gs))
        return tuple(reversed(out))

    def fit(self, v, out) -> str:
        """The IR name of operand ``v`` shaped so that IR broadcasting against ``out`` (its
        trailing groups) matches ONNX broadcasting: a size-1 dim spans its group's IR dims."""
        g = groups_of_value(v)
        tail = out[len(out) - len(g):]
        want = tuple(o if gi == o else (1,) * len(o) for gi, o in zip(g, tail))
        if isinstance(v, Tensor):
            return self.reshape(v, want).name
        return self.constant(v.value.reshape(flat(want))).name


def groups_of_value(v) -> tuple:
    return v.groups if isinstance(v, Tensor) else single(v.value.shape)


def folded_scalar(v, what: str, em: Emitter):
    """A Python number from a folded one-element value."""
    if not isinstance(v, Folded) or not v.const or v.value.size != 1:
        raise em.fail(f"{what} must be a constant")
    return v.value.reshape(()).item()
