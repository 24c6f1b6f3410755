"""A checkpoint file written piece by piece: the arrays' datasets are created at full size, a
callback fills them slice by slice, and the checksum is then computed by reading them back in
blocks. The file is the same as ``h5file`` writes (same layout, same checksum), so every
reader takes it; only the writer never needs a whole array in memory. No MPI here: the
caller's ``fill`` may receive the slices from other ranks (``checkpoint/stages.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.checkpoint import h5file as hf

# the checksum reads the datasets back in blocks of this size (the writer's memory bound)
BLOCK_BYTES = 4 << 20


@dataclass
class StagedArrays:
    """What a ``CheckpointState`` holds instead of its arrays when they are written in pieces.

    specs: name -> (dtype, shape), in the file's (and the checksum's) order.
    fill: called with name -> the (empty, full-size) h5py dataset; it writes every element.
    """
    specs: dict
    fill: Callable[[dict], None]

    def rows(self) -> list:
        return [[name, np.dtype(dt).str, list(shape)] for name, (dt, shape) in self.specs.items()]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
                   for dt, shape in self.specs.values())


def _hash_blocks(h, ds) -> None:
    """Feed a 1-D (or 0-d) dataset into the checksum, BLOCK_BYTES at a time."""
    nbytes = int(np.prod(ds.shape, dtype=np.int64)) * ds.dtype.itemsize
    h.update(nbytes.to_bytes(8, "little"))
    if ds.ndim == 0:
        h.update(hf.raw_bytes(hf.read_array(ds)))
        return
    rows = max(1, BLOCK_BYTES // max(1, nbytes // max(1, ds.shape[0])))
    for start in range(0, ds.shape[0], rows):
        h.update(hf.raw_bytes(np.ascontiguousarray(ds[start:start + rows])))


def write_staged(path: Path, manifest: bytes, meta: bytes, staged: StagedArrays) -> None:
    """``h5file.write_h5`` for piece-by-piece arrays; the checksum attribute comes last."""
    guarded = hf.GuardedFile(path)
    try:
        f = h5py.File(guarded, "w")
        try:
            group = hf.write_header(f, manifest, meta)
            datasets = {name: group.create_dataset(name, shape=tuple(shape), dtype=np.dtype(dt))
                        for name, (dt, shape) in staged.specs.items()}
            staged.fill(datasets)
            f.flush()
            guarded.raise_recorded()    # a failed write (disk full): no reading back garbage
            h = hashlib.sha256()
            hf.feed(h, manifest)
            hf.feed(h, meta)
            for name in staged.specs:
                _hash_blocks(h, datasets[name])
            f.attrs["checksum"] = "sha256:" + h.hexdigest()
            f.flush()
        finally:
            f.close()
        guarded.raise_recorded()
    finally:
        guarded.close()


@contextmanager
def open_arrays(path):
    """name -> h5py dataset of a checkpoint's arrays, read only (slices are read on demand);
    verify the file first (``read_checkpoint(path, arrays=False)``)."""
    with h5py.File(path, "r", locking=False) as f:
        out = {}
        f["arrays"].visititems(lambda name, obj: out.__setitem__(name, obj) if isinstance(obj, h5py.Dataset) else None)
        yield out
