"""A small helper for writing graphs in Python: it infers each node's shape and dtype."""

from __future__ import annotations

import json

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.ir import SCHEMA_VERSION, Graph
from hpc_rlx.graph.registry import OPS
from hpc_rlx.graph.shapes import FLOAT, ShapeError, TensorType


def _plain(value):
    """Tuples to lists, so attributes look the same before and after a JSON round trip."""
    return json.loads(json.dumps(value))


class GraphBuilder:
    """``b.input`` / ``b.param`` / ``b.op`` / ``b.output`` then ``b.build()``; each returns a name."""

    def __init__(self, name: str = "model", meta: dict | None = None):
        self.name = name
        self.meta = _plain(meta or {})
        self._inputs, self._params, self._nodes, self._outputs = [], [], [], {}
        self._types: dict[str, TensorType] = {}
        self._counter = 0

    def input(self, name: str, shape, dtype: str = FLOAT) -> str:
        self._inputs.append({"name": name, "shape": list(shape), "dtype": dtype})
        self._types[name] = TensorType(tuple(shape), dtype)
        return name

    def param(self, name: str, shape, init: dict, trainable: bool = True) -> str:
        """A parameter; ``trainable=False`` makes it a buffer (state an op updates, such as
        batch norm's running statistics), never differentiated."""
        spec = {"name": name, "shape": list(shape), "dtype": FLOAT, "init": _plain(init)}
        if not trainable:
            spec["trainable"] = False
        self._params.append(spec)
        self._types[name] = TensorType(tuple(shape), FLOAT)
        return name

    def op(self, op: str, *inputs: str, name: str | None = None, **attrs) -> str:
        if name is None:
            self._counter += 1
            name = f"{op}_{self._counter}"
        if op not in OPS:
            raise GraphError(f"node '{name}': unknown op {op!r}")
        missing = [r for r in inputs if r not in self._types]
        if missing:
            raise GraphError(f"node '{name}': input '{missing[0]}' refers to nothing defined so far")
        attrs = _plain(attrs)
        try:
            t = OPS[op].infer([self._types[r] for r in inputs], OPS[op].normalise(attrs))
        except ShapeError as exc:
            raise GraphError(f"node '{name}' (op '{op}'): {exc}") from None
        self._nodes.append(
            {"name": name, "op": op, "inputs": list(inputs), "attrs": attrs, "shape": list(t.shape), "dtype": t.dtype}
        )
        self._types[name] = t
        return name

    def type_of(self, name: str) -> TensorType:
        return self._types[name]

    def output(self, name: str, ref: str) -> None:
        self._outputs[name] = ref

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "inputs": self._inputs,
            "params": self._params,
            "nodes": self._nodes,
            "outputs": self._outputs,
            "meta": self.meta,
        }

    def build(self) -> Graph:
        return Graph.from_dict(self.to_dict())
