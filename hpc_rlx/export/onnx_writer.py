"""Builds one ONNX graph node by node: named tensors, constants, initializers, the finished model.

``onnx`` is optional: the writer takes the imported module from ``require_onnx`` so that only
an export that needs it pays for it (and a missing install is one clear error).
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.export.trained import ExportError

OPSET = 17
IR_VERSION = 8  # the IR version of opset 17: runtimes from 2022 on read the file
BATCH = "batch"  # the symbolic name of the dynamic batch dimension


def require_onnx():
    """The ``onnx`` module, or an ExportError saying how to install it."""
    try:
        import onnx
    except ImportError:
        raise ExportError("--onnx needs the onnx package: pip install onnx") from None
    return onnx


def optional_onnx():
    """The ``onnx`` module, or None when it is not installed."""
    try:
        import onnx
    except ImportError:
        return None
    return onnx


class OnnxWriter:
    """Collects nodes and initializers; ``tmp`` names helper tensors, ``const`` makes constants."""

    def __init__(self, onnx):
        self.onnx = onnx
        self.helper = onnx.helper
        self.nodes: list = []
        self.initializers: list = []
        self._names: set = set()
        self._consts: dict = {}
        self._counts: dict = {}  # base name -> the next suffix to try

    def tmp(self, base: str) -> str:
        """A fresh tensor name derived from ``base``."""
        k = self._counts.get(base, 0)
        while f"{base}/t{k}" in self._names:
            k += 1
        self._counts[base] = k + 1
        self._names.add(f"{base}/t{k}")
        return f"{base}/t{k}"

    def add(self, op_type: str, inputs, out: str | None = None, base: str = "", **attrs) -> str:
        """Append one node; returns its (single) output name, ``out`` or a fresh one."""
        out = out or self.tmp(base or op_type)
        self._names.add(out)
        node_name = self.tmp(f"{base or out}/{op_type}")
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], name=node_name, **attrs))
        return out

    def initializer(self, name: str, value: np.ndarray) -> str:
        self._names.add(name)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.require(value, None, "C"), name))
        return name

    def const(self, value, dtype=np.float32) -> str:
        """A constant tensor (shared between the nodes that use the same value)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer(self.tmp("const"), arr)
        return self._consts[key]

    def ints(self, values) -> str:
        return self.const(list(values), np.int64)


def value_info(onnx, name: str, dtype: str, shape) -> object:
    """A graph input/output description; ``None`` dims become the symbolic batch."""
    elem = onnx.TensorProto.INT64 if dtype == "int64" else onnx.TensorProto.FLOAT
    return onnx.helper.make_tensor_value_info(name, elem, [BATCH if d is None else d for d in shape])


def make_checked_model(onnx, graph_proto, opset: int, doc: str = ""):
    """A model around ``graph_proto`` at ``opset``, checked (see ``check_model``)."""
    model = onnx.helper.make_model(graph_proto, opset_imports=[onnx.helper.make_opsetid("", opset)],
                                   producer_name="hpc_rlx", doc_string=doc)
    model.ir_version = IR_VERSION
    return check_model(onnx, model)


def check_model(onnx, model):
    """``model`` after the ONNX checker (with shape inference) accepted it."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # noqa: BLE001 - the checker raises several types; all mean the same
        raise ExportError(f"the exported ONNX model fails the ONNX checker: {str(e).splitlines()[0]}") from None
    return model


def save_model(onnx, model, path) -> None:
    try:
        onnx.save_model(model, str(path))
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot write {path}: {e}") from None
