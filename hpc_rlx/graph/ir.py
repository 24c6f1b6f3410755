"""The model graph IR: a small, versioned, JSON-serialisable description of a model.

JSON form (``schema_version`` 1)::

    {"schema_version": 1, "name": "mlp",
     "inputs":  [{"name": "x", "shape": [null, 64], "dtype": "float"},
                 {"name": "y", "shape": [null], "dtype": "int64"}],
     "params":  [{"name": "fc0.weight", "shape": [64, 10], "dtype": "float",
                  "init": {"scheme": "he_normal", "fan_in": 64}}],
     "nodes":   [{"name": "logits", "op": "linear", "inputs": ["x", "fc0.weight"], "attrs": {},
                  "shape": [null, 10], "dtype": "float"}, ...],
     "outputs": {"loss": "xent", "correct": "correct"},
     "meta": {}}

``null`` in a shape is the batch size. ``"float"`` is the executor's compute dtype. The output
named ``loss`` is the scalar the gradients are taken of; every other output is a scalar metric.
Nodes may be listed in any order; they run in a topological order derived on load. Loading
validates everything and raises ``GraphError`` naming the offending node.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import ops as _ops  # noqa: F401  (registers the built-in ops and their VJPs)
from hpc_rlx.graph.params import check_init, param_dict, param_flags
from hpc_rlx.graph.registry import OPS
from hpc_rlx.graph.shapes import DTYPES, FLOAT, INT, ShapeError, TensorType, fmt_shape, known_prod

SCHEMA_VERSION = 1
LOSS = "loss"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_TOP_KEYS = {"schema_version", "name", "inputs", "params", "nodes", "outputs", "meta"}


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple  # None = batch dim
    dtype: str  # "float" or "int64"


@dataclass(frozen=True, eq=True)
class ParamSpec:
    name: str
    shape: tuple
    init: dict
    dtype: str = FLOAT  # parameters are always trained in the executor's compute dtype
    trainable: bool = True  # False: a buffer (batch-norm running statistics), never differentiated
    frozen: bool = False  # True: a parameter used as it is (model.freeze), never differentiated or stepped


@dataclass(frozen=True, eq=True)
class Node:
    name: str
    op: str
    inputs: tuple
    attrs: dict
    shape: tuple
    dtype: str


def _err(where: str, msg: str) -> GraphError:
    return GraphError(f"{where}: {msg}")


def _check_keys(obj, required, optional, where):
    if not isinstance(obj, dict):
        raise _err(where, f"must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise _err(where, f"missing field(s) {missing}")
    extra = sorted(set(obj) - set(required) - set(optional))
    if extra:
        raise _err(where, f"unknown field(s) {extra}")


def _name(obj, where) -> str:
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _err(where, f"name {name!r} must be 1-128 characters of letters, digits, '_', '.', '-'")
    return name


def _shape(value, where, allow_batch: bool) -> tuple:
    ok = isinstance(value, list) and all(
        (d is None and allow_batch) or (isinstance(d, int) and not isinstance(d, bool) and d >= 1) for d in value
    )
    if not ok:
        what = "positive ints or null (batch)" if allow_batch else "positive ints"
        raise _err(where, f"shape must be a list of {what}, got {value!r}")
    return tuple(value)


def _dtype(value, where) -> str:
    if value not in DTYPES:
        raise _err(where, f"dtype must be one of {list(DTYPES)}, got {value!r}")
    return value


def _json_copy(value, where):
    """A deep copy that is guaranteed to survive JSON exactly (lists, not tuples; no NaN)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise _err(where, f"is not plain JSON ({exc})") from None


def _read_param(i: int, obj, claim) -> ParamSpec:
    _check_keys(obj, ["name", "shape", "init"], ["dtype", "trainable", "frozen"], f"parameter #{i}")
    name = _name(obj, f"parameter #{i}")
    claim(name, "parameter")
    where = f"parameter '{name}'"
    shape = _shape(obj["shape"], where, False)
    init = _json_copy(obj["init"], where + " init")
    try:
        check_init(init, shape)
        trainable, frozen = param_flags(obj)
    except ValueError as exc:
        raise _err(where, str(exc)) from None
    if obj.get("dtype", FLOAT) != FLOAT:
        raise _err(where, f"dtype must be 'float' (the compute dtype), got {obj['dtype']!r}")
    return ParamSpec(name, shape, init, trainable=trainable, frozen=frozen)


def _read_node(i: int, obj, claim) -> Node:
    _check_keys(obj, ["name", "op", "inputs", "shape", "dtype"], ["attrs"], f"node #{i}")
    name = _name(obj, f"node #{i}")
    claim(name, "node")
    where = f"node '{name}'"
    op = obj["op"]
    if not isinstance(op, str) or op not in OPS:
        raise _err(where, f"unknown op {op!r} (known: {', '.join(sorted(OPS))})")
    refs = obj["inputs"]
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise _err(where, f"inputs must be a list of names, got {refs!r}")
    attrs = _json_copy(obj.get("attrs", {}), where + " attrs")
    if not isinstance(attrs, dict):
        raise _err(where, "attrs must be a JSON object")
    shape = _shape(obj["shape"], where, True)
    return Node(name, op, tuple(refs), attrs, shape, _dtype(obj["dtype"], where))


# Ops whose output holds the same ids as their first input, only moved or copied.
ID_MOVING_OPS = frozenset({"reshape", "transpose", "slice", "flatten", "concat", "expand", "cast",
                           "gather"})


class Graph:
    """A validated model graph. Build one with ``from_dict`` / ``from_json`` / ``from_file``
    or with the model builders; it is immutable afterwards."""

    # A pipeline stage (``partition.StageGraph``) takes values of earlier stages as inputs and
    # hands values to later ones; only the last stage has the loss. A whole graph has neither.
    boundary_inputs: tuple = ()
    boundary_outputs: tuple = ()
    requires_loss = True
    param_seeds = None  # a stage: each parameter's index in the whole graph (its init stream)

    def __init__(self, d: dict):
        """Validate the JSON-shaped dict ``d`` (prefer ``Graph.from_dict``)."""
        _check_keys(d, ["schema_version", "inputs", "params", "nodes", "outputs"], ["name", "meta"], "graph")
        version = d["schema_version"]
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise GraphError(f"graph: schema_version {version!r} is not supported (this hpc_rlx reads {SCHEMA_VERSION})")
        self.name = d.get("name", "model")
        if not isinstance(self.name, str):
            raise GraphError(f"graph: name must be a string, got {self.name!r}")
        self.meta = _json_copy(d.get("meta", {}), "graph meta")
        if not isinstance(self.meta, dict):
            raise GraphError("graph: meta must be a JSON object")
        for key in ("inputs", "params", "nodes"):
            if not isinstance(d[key], list):
                raise GraphError(f"graph: '{key}' must be a list")

        kinds: dict[str, str] = {}  # name -> "input" / "parameter" / "node"

        def claim(name, kind):
            if name in kinds:
                raise GraphError(f"{kind} '{name}': duplicate name (already used by a {kinds[name]})")
            kinds[name] = kind

        self.inputs: list[InputSpec] = []
        for i, obj in enumerate(d["inputs"]):
            _check_keys(obj, ["name", "shape", "dtype"], [], f"input #{i}")
            name = _name(obj, f"input #{i}")
            claim(name, "input")
            where = f"input '{name}'"
            self.inputs.append(InputSpec(name, _shape(obj["shape"], where, True), _dtype(obj["dtype"], where)))
        self.params: list[ParamSpec] = [_read_param(i, obj, claim) for i, obj in enumerate(d["params"])]
        self.nodes: list[Node] = [_read_node(i, obj, claim) for i, obj in enumerate(d["nodes"])]
        for node in self.nodes:
            for ref in node.inputs:
                if ref not in kinds:
                    raise GraphError(f"node '{node.name}': input '{ref}' refers to no graph input, parameter or node")

        outputs = d["outputs"]
        if not isinstance(outputs, dict) or not all(isinstance(v, str) for v in outputs.values()):
            raise GraphError("graph: outputs must map output names to node names")
        self.outputs: dict[str, str] = dict(outputs)
        if LOSS not in self.outputs and self.requires_loss:
            raise GraphError(f"graph: missing the '{LOSS}' output (outputs are {sorted(self.outputs) or 'empty'})")
        for out_name, ref in self.outputs.items():
            if not _NAME.match(out_name):
                raise GraphError(f"output {out_name!r}: invalid name")
            if kinds.get(ref) != "node":
                raise GraphError(f"output '{out_name}': refers to '{ref}', which is not a node")

        self.order = self._topological_order()
        self.types: dict[str, TensorType] = {s.name: TensorType(s.shape, s.dtype) for s in self.inputs}
        self.types.update({p.name: TensorType(p.shape, FLOAT) for p in self.params})
        self.norm_attrs: dict[str, dict] = {}
        for idx in self.order:
            self._infer(self.nodes[idx])

        for out_name, ref in self.outputs.items():
            t = self.types[ref]
            if t.shape != ():
                raise GraphError(f"output '{out_name}': node '{ref}' must be a scalar, got shape {fmt_shape(t.shape)}")
            if out_name == LOSS and t.dtype != FLOAT:
                raise GraphError(f"output '{out_name}': node '{ref}' must be float, got {t.dtype}")

    # ------------------------------------------------------------------ validation helpers

    def _topological_order(self) -> list:
        """Kahn's algorithm; keeps the listed order where it is already valid."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        deps = [{index[r] for r in n.inputs if r in index} for n in self.nodes]
        users = [[] for _ in self.nodes]
        for i, ds in enumerate(deps):
            for j in ds:
                users[j].append(i)
        waiting = [len(ds) for ds in deps]
        ready = [i for i, w in enumerate(waiting) if w == 0]
        ready.reverse()
        order = []
        while ready:
            i = ready.pop()
            order.append(i)
            for u in sorted(users[i], reverse=True):
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(u)
            ready.sort(reverse=True)
        if len(order) < len(self.nodes):
            raise GraphError(self._cycle_message({i for i, w in enumerate(waiting) if w > 0}, deps))
        return order

    def _cycle_message(self, stuck: set, deps) -> str:
        """Every node Kahn could not schedule waits on another such node: follow those until one repeats."""
        seen, path, i = {}, [], min(stuck)
        while i not in seen:
            seen[i] = len(path)
            path.append(i)
            i = min(j for j in deps[i] if j in stuck)
        loop = [self.nodes[j].name for j in reversed(path[seen[i] :])]
        return f"node '{loop[0]}': part of a cycle: {' -> '.join(loop + [loop[0]])}"

    def _infer(self, node: Node) -> None:
        opdef = OPS[node.op]
        where = f"node '{node.name}' (op '{node.op}')"
        lo, hi = opdef.arity
        if not lo <= len(node.inputs) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise GraphError(f"{where}: takes {want} inputs, got {len(node.inputs)}")
        in_types = [self.types[r] for r in node.inputs]
        try:
            attrs = opdef.normalise(node.attrs)
            t = opdef.infer(in_types, attrs)
        except ShapeError as exc:
            listing = ", ".join(f"'{r}' {self.types[r]}" for r in node.inputs)
            raise GraphError(f"{where}: {exc}; inputs: {listing}") from None
        if t.dtype != node.dtype:
            raise GraphError(f"{where}: declared dtype {node.dtype} but the op gives {t.dtype}")
        if t.shape != node.shape:
            raise GraphError(
                f"{where}: declared shape {fmt_shape(node.shape)} but the op gives {fmt_shape(t.shape)}"
            )
        self.types[node.name] = t
        self.norm_attrs[node.name] = attrs

    # ------------------------------------------------------------------ serialisation

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        return cls(d)

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise GraphError(f"graph JSON is malformed: {exc}") from None
        return cls(d)

    @classmethod
    def from_file(cls, path) -> "Graph":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise GraphError(f"graph file {str(path)!r} cannot be read: {exc}") from None
        try:
            d = json.loads(text)
        except ValueError as exc:
            raise GraphError(f"graph file {str(path)!r} is not valid JSON: {exc}") from None
        try:
            return cls(d)
        except GraphError as exc:
            raise GraphError(f"graph file {str(path)!r}: {exc}") from None

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in self.inputs],
            "params": [param_dict(p) for p in self.params],
            "nodes": [
                {
                    "name": n.name,
                    "op": n.op,
                    "inputs": list(n.inputs),
                    "attrs": copy.deepcopy(n.attrs),
                    "shape": list(n.shape),
                    "dtype": n.dtype,
                }
                for n in self.nodes
            ],
            "outputs": dict(self.outputs),
            "meta": copy.deepcopy(self.meta),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_file(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: equal iff the graphs are equal."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()

    def __eq__(self, other) -> bool:
        return isinstance(other, Graph) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.inputs)} inputs, {len(self.params)} params, {len(self.nodes)} nodes)"

    # ------------------------------------------------------------------ queries

    @property
    def loss_name(self) -> str:
        return LOSS

    @property
    def result_names(self) -> tuple:
        """The model's outputs (a pipeline stage: those of the whole graph it is part of)."""
        return tuple(self.outputs)

    @property
    def metric_names(self) -> list:
        return [k for k in self.outputs if k != LOSS]

    def input(self, name: str) -> InputSpec:
        for s in self.inputs:
            if s.name == name:
                return s
        raise KeyError(name)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def num_params(self) -> int:
        """Trainable parameter elements (buffers are state, frozen ones are not trained)."""
        return sum(known_prod(p.shape) for p in self.params if p.trainable and not p.frozen)

    @property
    def buffers(self) -> list:
        """The non-trainable parameters (batch-norm running statistics), in declaration order."""
        return [p for p in self.params if not p.trainable]

    def buffer_momentum(self) -> dict:
        """buffer name -> the rate its running update moves towards the step's statistic
        (`buffer += momentum * (statistic - buffer)`): the `momentum` attribute of the node
        that reads the buffer; 0 (never updated) for a buffer no node updates."""
        rates = {p.name: 0.0 for p in self.buffers}
        for n in self.nodes:
            for ref in n.inputs:
                if ref in rates and "momentum" in self.norm_attrs.get(n.name, {}):
                    rates[ref] = float(self.norm_attrs[n.name]["momentum"])
        return rates

    def _loss_node(self) -> Node:
        return self.node(self.outputs[LOSS])

    @property
    def num_classes(self):
        """Classes the labels index (softmax cross-entropy losses), else None."""
        node = self._loss_node()
        if node.op == "softmax_cross_entropy":     # the class axis: 1 or the last (ops/loss.py)
            logits, labels = (self.types[r].shape for r in node.inputs)
            return logits[_ops.loss.class_axis(logits, labels, self.norm_attrs[node.name]["axis"])]
        return None

    @property
    def token_vocab(self):
        """(rows, table name) of the smallest embedding table that the input `x` indexes directly
        (through ops that only move ids, never compute on them), else None. Position tables that
        ids reach through arithmetic (position ids built from a mask) do not bound the token ids."""
        reached, found = {"x"}, None
        for node in (self.nodes[i] for i in self.order):
            if not any(r in reached for r in node.inputs):
                continue
            if node.op == "embedding" and node.inputs[0] in reached:
                rows = self.types[node.inputs[1]].shape[0]
                if found is None or rows < found[0]:
                    found = (rows, node.inputs[1])
            elif node.op in ID_MOVING_OPS and node.inputs[0] in reached:
                reached.add(node.name)
        return found

    @property
    def predictions_per_sample(self) -> int:
        """Labelled positions per sample: 1 for classifiers, seq_len for a language model."""
        node = self._loss_node()
        labels = [r for r in node.inputs if self.types[r].dtype == INT]
        if labels:
            return known_prod(self.types[labels[0]].shape[1:])
        return 1
