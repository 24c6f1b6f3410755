"""One-sample files read without HDF5 when they are laid out like one read through it
(`data/one_sample.py`): the shortcut must give what HDF5 gives, or step aside."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from hpc_rlx.data.files import Meta
from hpc_rlx.data.fileset import FileSet
from hpc_rlx.data.one_sample import Layout, OneSampleReader
from hpc_rlx.data.set_reader import read_set
from hpc_rlx.base.errors import DataError

SHAPE = (4, 5, 3)


def _write(path, x, y, attr: str | None = None) -> None:
    with h5py.File(path, "w") as f:
        f["climate/data"], f["climate/labels"] = x, y
        if attr is not None:         # same size, other metadata bytes
            f.attrs["note"] = attr


def _ref(dtype=np.float32) -> Meta:
    return Meta(1, SHAPE, np.dtype(dtype), (), np.dtype(np.int64))


def _files(tmp_path, n, dtype=np.float32):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n,) + SHAPE).astype(dtype)
    y = rng.integers(0, 7, n).astype(np.int64)
    paths = [str(tmp_path / f"f{i:03d}.h5") for i in range(n)]
    for p, xi, yi in zip(paths, x, y):
        _write(p, xi, yi)
    return paths, x, y


def test_files_written_alike_are_read_by_layout_and_equal_hdf5s_reading(tmp_path):
    paths, x, y = _files(tmp_path, 12)
    reader = OneSampleReader("climate/data", "climate/labels", _ref(), paths[0])
    bx, by = np.empty((12,) + SHAPE, np.float32), np.empty(12, np.int64)
    for i, p in enumerate(paths):
        reader.read(p, p, bx, by, i)
    assert np.array_equal(bx, x) and np.array_equal(by, y)
    assert reader.fast_reads == 11          # every file after the first skipped HDF5
    # labels alone (x_out None), and a cast while reading (float64 run of a float32 file)
    only_y = np.empty(12, np.int64)
    for i, p in enumerate(paths):
        reader.read(p, p, None, only_y, i)
    assert np.array_equal(only_y, y)
    fs = FileSet(tuple(paths), (1,) * 12, True)
    gx, gy = read_set(fs, "climate/data", "climate/labels", 2, 10, _ref(), paths[0], x_dtype=np.float64)
    assert gx.dtype == np.float64 and np.array_equal(gx, x[2:10].astype(np.float64)) and np.array_equal(gy, y[2:10])


def test_a_file_of_the_same_size_with_another_dtype_is_not_read_by_layout(tmp_path):
    """int32 and float32 samples of one shape make files of one size: only the metadata
    bytes tell them apart, so the shortcut must compare them and let HDF5 say what differs."""
    paths, x, y = _files(tmp_path, 3)
    odd = str(tmp_path / "f001.h5")
    _write(odd, np.arange(60, dtype=np.int32).reshape(SHAPE), y[1])
    assert os.path.getsize(odd) == os.path.getsize(paths[0])
    reader = OneSampleReader("climate/data", "climate/labels", _ref(), paths[0])
    bx, by = np.empty((3,) + SHAPE, np.float32), np.empty(3, np.int64)
    reader.read(paths[0], paths[0], bx, by, 0)
    with pytest.raises(DataError, match=r"f001.h5.*dtype int32 there, float32"):
        reader.read(odd, odd, bx, by, 1)
    reader.read(paths[2], paths[2], bx, by, 2)
    assert np.array_equal(bx[2], x[2]) and reader.fast_reads == 1


def test_files_with_other_metadata_fall_back_to_hdf5_and_stop_being_tried(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((30,) + SHAPE).astype(np.float32)
    paths = [str(tmp_path / f"g{i:03d}.h5") for i in range(30)]
    for i, p in enumerate(paths):
        _write(p, x[i], np.int64(i), attr=f"file {i:03d}")      # per-file bytes, as timestamps are
    reader = OneSampleReader("climate/data", "climate/labels", _ref(), paths[0])
    bx, by = np.empty((30,) + SHAPE, np.float32), np.empty(30, np.int64)
    for i, p in enumerate(paths):
        reader.read(p, p, bx, by, i)
    assert np.array_equal(bx, x) and np.array_equal(by, np.arange(30)) and reader.fast_reads == 0


def test_a_truncated_or_removed_file_is_one_error_naming_it(tmp_path):
    paths, _, _ = _files(tmp_path, 4)
    reader = OneSampleReader("climate/data", "climate/labels", _ref(), paths[0])
    bx, by = np.empty((4,) + SHAPE, np.float32), np.empty(4, np.int64)
    reader.read(paths[0], paths[0], bx, by, 0)
    os.truncate(paths[1], 1000)
    with pytest.raises(DataError, match=r"f001.h5"):
        reader.read(paths[1], paths[1], bx, by, 1)
    os.remove(paths[2])
    with pytest.raises(DataError, match=r"dataset file .*f002.h5' does not exist"):
        reader.read(paths[2], paths[2], bx, by, 2)


def test_layout_keeps_every_byte_outside_the_two_datasets(tmp_path):
    paths, _, _ = _files(tmp_path, 1)
    with h5py.File(paths[0], "r") as f:
        xo, yo = f["climate/data"].id.get_offset(), f["climate/labels"].id.get_offset()
    layout = Layout.of_file(paths[0], (xo, 240), (yo, 8))
    size = os.path.getsize(paths[0])
    assert layout.size == size and sum(len(g) for _, g in layout.gaps) == size - 248
    assert Layout.of_file(paths[0], (xo, 240), (xo + 8, 8)) is None       # overlapping ranges
