"""A checkpoint written in pieces (`StagedArrays`, what a pipelined run's rank 0 writes one stage
at a time): the same file as one written from whole arrays, and the same atomic protocol (a
failed write leaves the previous checkpoint and `latest` as they were, and no temporary file)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.checkpoint import CheckpointManager, CheckpointState, read_checkpoint
from hpc_rlx.checkpoint.staged_file import StagedArrays


def test_staged_arrays_write_the_same_file_and_a_failed_fill_changes_nothing(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"params": rng.standard_normal(1000), "opt/m": rng.standard_normal(900)}
    mgr = CheckpointManager(tmp_path, keep_last=5)
    first = mgr.save(CheckpointState(arrays, {"step": 1}), step=1)

    def fill(ds):       # in pieces, out of order
        for name, a in arrays.items():
            ds[name][500:] = a[500:]
            ds[name][:500] = a[:500]
    staged = StagedArrays({k: (a.dtype, a.shape) for k, a in arrays.items()}, fill)
    path = mgr.save(CheckpointState(staged, {"step": 2}), step=2)
    got = read_checkpoint(path)
    assert list(got.arrays) == list(arrays)
    for k in arrays:
        assert np.array_equal(got.arrays[k], arrays[k])

    def broken(ds):
        ds["params"][:10] = 1.0
        raise OSError(28, "No space left on device")
    with pytest.raises(Exception, match="could not write checkpoint"):
        mgr.save(CheckpointState(StagedArrays(staged.specs, broken), {"step": 3}), step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, path.name, "latest"]
    assert (tmp_path / "latest").read_text().strip() == path.name
