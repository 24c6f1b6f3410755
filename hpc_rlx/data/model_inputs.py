"""Several model inputs (`data.x=[input_ids, attention_mask]`) as one array of rows.

Each input's rows are read as a single `data.x` is (`load_shard`: `read` or `scatter`, a file,
a directory or a glob) and laid side by side, each flattened, in `data.x` order. The model's
graph cuts them apart again (`graph/onnx/packed_inputs.py`), so the feed, the lanes'
micro-batches and validation move one array as they do for one input. The packed rows are
int64 when every input holds integers (ids and masks stay exact), else float64.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hpc_rlx.base.errors import DataError
from hpc_rlx.data.distribute import load_shard
from hpc_rlx.data.files import Meta


def packed_dtype(dtypes) -> np.dtype:
    return np.dtype(np.int64 if all(np.dtype(t).kind in "iub" for t in dtypes) else np.float64)


def pack_rows(arrays: list, dtype) -> np.ndarray:
    """The inputs' rows side by side, each flattened: (rows, sum of the row sizes)."""
    n = len(arrays[0])
    return np.concatenate([a.reshape(n, -1).astype(dtype, copy=False) for a in arrays], axis=1)


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
