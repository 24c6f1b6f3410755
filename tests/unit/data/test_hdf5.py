"""describe / check_compatible / read_rows / check_values: results and error messages."""

import h5py
import numpy as np
import pytest

from hpc_rlx.data import hdf5
from hpc_rlx.data.hdf5 import DatasetInfo, check_compatible, check_values, describe, read_rows
from hpc_rlx.base.errors import DataError


def _write(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f.create_dataset(name, data=data)
        f.attrs["num_classes"] = 3
        f.attrs["source"] = "unit test"
    return str(path)


@pytest.fixture
def good(tmp_path):
    rng = np.random.default_rng(0)
    return _write(tmp_path / "good.h5", x=rng.standard_normal((20, 1, 4, 4)).astype(np.float32),
                  y=rng.integers(0, 3, 20))


def test_describe(good):
    info = describe(good, "x", "y")
    assert isinstance(info, DatasetInfo)
    assert (info.path, info.n) == (good, 20)
    assert info.x_shape == (1, 4, 4) and info.x_dtype == np.float32
    assert info.y_shape == () and info.y_dtype == np.int64
    assert info.attrs == {"num_classes": 3, "source": "unit test"}
    assert type(info.attrs["num_classes"]) is int


def test_describe_nested_names(tmp_path):
    p = tmp_path / "nested.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("train/images", data=np.zeros((5, 2)))
        f.create_dataset("train/labels", data=np.zeros(5, dtype=np.int32))
    info = describe(p, "train/images", "train/labels")
    assert (info.n, info.x_shape, info.y_dtype) == (5, (2,), np.int32)


def test_describe_missing_file(tmp_path):
    p = str(tmp_path / "absent.h5")
    with pytest.raises(DataError, match=f"dataset file '{p}' does not exist"):
        describe(p, "x", "y")


def test_describe_not_hdf5(tmp_path):
    p = tmp_path / "notes.h5"
    p.write_text("x,y\n1,2\n")
    with pytest.raises(DataError, match="notes.h5' is not an HDF5 file"):
        describe(p, "x", "y")
    with pytest.raises(DataError, match="is a directory"):
        describe(tmp_path, "x", "y")


def test_describe_missing_dataset_lists_existing(tmp_path):
    p = _write(tmp_path / "f.h5", inputs=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    with pytest.raises(DataError) as ei:
        describe(p, "x", "y")
    msg = str(ei.value)
    assert "f.h5" in msg and "'x'" in msg and "['inputs', 'y']" in msg


def test_describe_group_instead_of_dataset(tmp_path):
    p = tmp_path / "g.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x/data", data=np.zeros((3, 2)))
        f.create_dataset("y", data=np.zeros(3, dtype=np.int64))
    with pytest.raises(DataError, match="'x' in HDF5 file .* is a group, not a dataset.*'x/data'"):
        describe(p, "x", "y")


def test_describe_empty_and_scalar(tmp_path):
    p = _write(tmp_path / "e.h5", x=np.zeros((0, 3), dtype=np.float32), y=np.zeros(0, dtype=np.int64))
    with pytest.raises(DataError, match=r"dataset 'x' in .*e.h5' is empty \(shape \(0, 3\)\)"):
        describe(p, "x", "y")
    p = _write(tmp_path / "s.h5", x=np.float32(1.0), y=np.zeros(1, dtype=np.int64))
    with pytest.raises(DataError, match="'x' in .* is a scalar"):
        describe(p, "x", "y")


def test_describe_length_mismatch(tmp_path):
    p = _write(tmp_path / "m.h5", x=np.zeros((10, 3), dtype=np.float32), y=np.zeros(9, dtype=np.int64))
    with pytest.raises(DataError, match="'x' and labels 'y' in .*m.h5' have different lengths: 10 vs 9 rows"):
        describe(p, "x", "y")


def _info(x_shape=(1, 4, 4), x_dtype="float32", y_shape=(), y_dtype="int64"):
    return DatasetInfo("d.h5", 10, x_shape, np.dtype(x_dtype), y_shape, np.dtype(y_dtype), {})


def test_check_compatible_accepts():
    check_compatible(_info(), (1, 4, 4), "float", "class", ())
    check_compatible(_info(), (None, 4, -1), "float", "class", ())  # wildcards
    check_compatible(_info(x_dtype="uint8"), (1, 4, 4), "float", "class", ())  # cast to float
    check_compatible(_info((16,), "int64", (16,), "int64"), (16,), "int", "class", (16,))
    check_compatible(_info(y_shape=(2,), y_dtype="float32"), (1, 4, 4), "float", "float", (2,))


def test_check_compatible_shape_mismatch_shows_both():
    with pytest.raises(DataError, match=r"input shape of 'x' is \(1, 4, 4\), but the model expects \(64,\)"):
        check_compatible(_info(), (64,), "float", "class", ())
    with pytest.raises(DataError, match=r"label shape of 'y' is \(\), but the model expects \(16,\)"):
        check_compatible(_info(), (1, 4, 4), "float", "class", (16,))


def test_check_compatible_dtypes():
    with pytest.raises(DataError, match="labels 'y' have dtype float32.*integer class indices.*float labels"):
        check_compatible(_info(y_dtype="float32"), (1, 4, 4), "float", "class", ())
    with pytest.raises(DataError, match="inputs 'x' have dtype float32, but the model needs integer token ids"):
        check_compatible(_info(), (1, 4, 4), "int", "class", ())
    with pytest.raises(ValueError, match="input_dtype_kind"):
        check_compatible(_info(), (1, 4, 4), "double", "class", ())


def test_read_rows_reads_only_the_hyperslab(good, monkeypatch):
    with h5py.File(good, "r") as f:
        x_all, y_all = f["x"][()], f["y"][()]
    seen = []
    orig = h5py.Dataset.read_direct

    def spy(self, dest, source_sel=None, dest_sel=None):
        seen.append((self.name, source_sel))
        return orig(self, dest, source_sel, dest_sel)

    monkeypatch.setattr(h5py.Dataset, "read_direct", spy)
    x, y = read_rows(good, "x", "y", 5, 12)
    np.testing.assert_array_equal(x, x_all[5:12])
    np.testing.assert_array_equal(y, y_all[5:12])
    assert seen == [("/x", np.s_[5:12]), ("/y", np.s_[5:12])]
    x, y = read_rows(good, "x", "y", 7, 7)
    assert x.shape == (0, 1, 4, 4) and x.dtype == np.float32 and y.shape == (0,)
    with pytest.raises(DataError, match=r"row range \[15, 21\) is outside dataset .* with 20 rows"):
        read_rows(good, "x", "y", 15, 21)


def test_read_rows_native_byte_order(tmp_path):
    x = np.arange(12, dtype=">f4").reshape(6, 2)
    p = _write(tmp_path / "be.h5", x=x, y=np.arange(6, dtype=">i8"))
    rx, ry = read_rows(p, "x", "y", 1, 4)
    assert rx.dtype.isnative and ry.dtype.isnative
    np.testing.assert_array_equal(rx, x[1:4])


def test_check_values_labels():
    x = np.zeros((6, 2), dtype=np.float32)
    check_values(x, np.array([0, 1, 2, 2, 1, 0]), 3, True)
    with pytest.raises(DataError) as ei:
        check_values(x, np.array([0, 1, 2, 3, -1, 7]), 3, False, first_row=100)
    msg = str(ei.value)
    assert "label 3 at row 103" in msg and "[0, 3)" in msg and "3 bad label(s)" in msg
    with pytest.raises(DataError, match="label -2 at row 11"):
        check_values(x, np.array([0, 1, 2, 0, 1, -2]), 3, False, first_row=6)
    check_values(x, np.array([0.5, 9.0, 1, 1, 1, 1]), None, True)  # regression: no label check


def test_check_values_sequence_labels():
    y = np.zeros((4, 5), dtype=np.int64)
    y[2, 3] = 99
    with pytest.raises(DataError, match=r"label 99 at row 12 \(position \(3,\)\) is outside \[0, 50\)"):
        check_values(np.zeros((4, 5), dtype=np.int64), y, 50, True, first_row=10)


def test_check_values_finite(monkeypatch):
    monkeypatch.setattr(hdf5, "_SCAN_ELEMS", 8)  # several scan blocks
    x = np.ones((10, 3), dtype=np.float32)
    y = np.zeros(10, dtype=np.int64)
    check_values(x, y, 2, True)
    x[7, 1] = np.nan
    x[9, 0] = np.inf
    with pytest.raises(DataError, match="input row 57 contains a non-finite value \\(nan\\)"):
        check_values(x, y, 2, True, first_row=50)
    check_values(x, y, 2, False)  # check off: accepted
