"""Several model inputs (`data.x=[input_ids, attention_mask]`) as one array of rows.

Each input's rows are read as a single `data.x` is (`load_shard`: `read` or `scatter`, a file,
a directory or a glob) and laid side by side, each flattened, in `data.x` order. The model's
graph cuts them apart again (`graph/onnx/packed_inputs.py`), so the feed, the lanes'
micro-batches and validation move one array as they do for one input. The packed rows are
int64 when every input holds integers (ids and masks stay exact), else float64. With
data.cache=stream, `PackedSource` reads each window's rows of every input and packs them.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hpc_rlx.base.errors import DataError
from hpc_rlx.data.distribute import load_shard
from hpc_rlx.data.files import Meta
from hpc_rlx.data.set_source import SetSource


def packed_dtype(dtypes) -> np.dtype:
    return np.dtype(np.int64 if all(np.dtype(t).kind in "iub" for t in dtypes) else np.float64)


def pack_rows(arrays: list, dtype) -> np.ndarray:
    """The inputs' rows side by side, each flattened: (rows, sum of the row sizes)."""
    n = len(arrays[0])     # no rows too (a rank without validation rows)
    return np.concatenate([a.reshape(n, int(np.prod(a.shape[1:], dtype=np.int64))).astype(dtype, copy=False)
                           for a in arrays], axis=1)


def packed_sources(names: list, describe):
    """(the training set described once, with the inputs packed, [(name, row shape, dtype)]):
    `describe(name)` gives a name's `Sources`; every input must have as many rows."""
    sources = [describe(n) for n in names]
    first = sources[0]
    for name, src in zip(names[1:], sources[1:]):
        if src.info.n != first.info.n or (src.vinfo and src.vinfo.n != first.vinfo.n):
            raise DataError(f"data.x datasets {names[0]!r} and {name!r} of {first.info.path} hold different "
                            f"numbers of samples ({first.info.n} and {src.info.n})")
    inputs = [(n, tuple(s.info.x_shape), str(s.info.x_dtype)) for n, s in zip(names, sources)]
    width = sum(int(np.prod(shape, dtype=np.int64)) for _, shape, _ in inputs)
    dtype = packed_dtype(t for _, _, t in inputs)

    def packed(info):
        return None if info is None else replace(info, x_shape=(width,), x_dtype=dtype, x_name=",".join(names))
    return replace(first, info=packed(first.info), vinfo=packed(first.vinfo)), inputs


def load_packed(comm, mode: str, files, inputs: list, y_name: str, bounds, expect) -> tuple:
    """(packed x, y) of this rank's rows: each input read as `load_shard` reads `data.x`."""
    ref, ref_path = expect
    xs, y = [], None
    for name, shape, dtype in inputs:
        meta = Meta(ref.n, tuple(shape), np.dtype(dtype).newbyteorder("="), ref.y_shape, ref.y_dtype)
        x, y = load_shard(comm, mode, files, name, y_name, bounds, expect=(meta, ref_path))
        xs.append(x)
    return pack_rows(xs, packed_dtype(t for _, _, t in inputs)), y


class PackedSource:
    """`SetSource`'s reading interface (data.cache=stream) over several inputs: each input's rows
    read by a SetSource of its own, then packed into the caller's buffer. Not shared between
    threads, as SetSource."""

    def __init__(self, files, inputs: list, y_name: str, ref: Meta, ref_path: str):
        self.parts = [SetSource(files, name, y_name, Meta(ref.n, tuple(shape), np.dtype(dtype).newbyteorder("="),
                                                          ref.y_shape, ref.y_dtype), ref_path)
                      for name, shape, dtype in inputs]
        self.path, self.n = self.parts[0].path, self.parts[0].n
        self.x_shape, self.y_shape = tuple(ref.x_shape), tuple(ref.y_shape)
        self.x_dtype, self.y_dtype = np.dtype(ref.x_dtype), np.dtype(ref.y_dtype)
        self.row_bytes = (self.x_dtype.itemsize * int(np.prod(self.x_shape, dtype=np.int64))
                          + self.parts[0].y_bytes)

    def _packed(self, n: int, read_part, x_out, y_out, at: int) -> None:
        """Each part's n rows (`read_part(part, x, y)`) into x_out/y_out[at : at + n]."""
        xs = []
        for part in self.parts:
            x, y = part.empty(n)
            read_part(part, x, y)
            xs.append(x)
        x_out[at:at + n] = pack_rows(xs, self.x_dtype)
        y_out[at:at + n] = y

    def read(self, rows: np.ndarray, x_out: np.ndarray, y_out: np.ndarray, at: int = 0) -> None:
        self._packed(len(rows), lambda part, x, y: part.read(rows, x, y), x_out, y_out, at)

    def read_range(self, start: int, stop: int, x_out, y_out: np.ndarray, at: int = 0) -> None:
        if x_out is None:       # the labels alone
            self.parts[0].read_range(start, stop, None, y_out, at)
            return
        self._packed(stop - start, lambda part, x, y: part.read_range(start, stop, x, y), x_out, y_out, at)

    def check(self, start: int, stop: int) -> None:
        for part in self.parts:
            part.check(start, stop)

    def decode_factor(self, window_rows: int, span_rows: int) -> float:
        return max(part.decode_factor(window_rows, span_rows) for part in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()
