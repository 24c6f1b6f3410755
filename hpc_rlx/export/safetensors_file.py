"""The safetensors format, written with NumPy alone (no torch, no safetensors package).

Layout: an 8-byte little-endian header length N, N bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, space-padded so the data starts
8-byte aligned), then every tensor's raw little-endian C-order bytes, back to back, in the
order of the header's offsets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from hpc_rlx.export.trained import ExportError

_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
           "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def safetensors_bytes(tensors: dict, metadata: dict | None = None) -> tuple[bytes, list]:
    """(header bytes, the tensors' little-endian arrays in file order)."""
    header, arrays, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, value in tensors.items():
        a = np.asarray(value)
        code = _DTYPES.get(a.dtype.name)
        if code is None:
            raise ExportError(f"tensor {name!r} has dtype {a.dtype}, which safetensors does not store")
        a = np.require(a, a.dtype.newbyteorder("<"), "C")  # keeps 0-d arrays 0-d
        header[name] = {"dtype": code, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        arrays.append(a)
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, arrays


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``tensors`` (name -> array) atomically (a temporary file renamed over ``path``)."""
    path = Path(path)
    head, arrays = safetensors_bytes(tensors, metadata)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for a in arrays:
                f.write(a.reshape(-1).view(np.uint8).data)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ExportError(f"cannot write {path}: {e}") from None


_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def read_float_tensors(path) -> dict:
    """The floating-point tensors of a safetensors file (name -> float32 array; bfloat16 widened),
    e.g. a PyTorch module's original weights; other dtypes are left out."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            data = f.read()
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read {path} as safetensors: {e}") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        begin, end = entry["data_offsets"]
        raw, code = data[begin:end], entry.get("dtype")
        if code == "BF16":  # the upper half of a float32
            value = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif code in _FLOATS:
            value = np.frombuffer(raw, _FLOATS[code]).astype(np.float32)
        else:
            continue
        out[name] = value.reshape(entry["shape"])
    return out
