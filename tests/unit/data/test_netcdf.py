"""A netCDF-4 file is an HDF5 file: a directory of `.nc` files written by a netCDF library is
a data set, its variables read like datasets (by name, inside groups too)."""

from __future__ import annotations

import h5netcdf
import numpy as np

from hpc_rlx.data.files import describe_set, meta_of, resolve
from hpc_rlx.data.set_reader import read_set
from hpc_rlx.data.set_source import SetSource


def _write_nc(path, x: np.ndarray, label: int) -> None:
    with h5netcdf.File(path, "w") as f:           # netCDF-4: dimensions, variables, attributes
        f.dimensions = {"lat": x.shape[0], "lon": x.shape[1], "channel": x.shape[2]}
        f.attrs["title"] = "one sample"
        g = f.create_group("climate")
        v = g.create_variable("data", ("lat", "lon", "channel"), dtype=x.dtype)
        v[...] = x
        v.attrs["units"] = "K"
        g.create_variable("labels", (), dtype=np.int64)[...] = label


def test_a_directory_of_netcdf4_files_is_a_data_set(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4, 5, 3)).astype(np.float32)
    for i in range(6):
        _write_nc(tmp_path / f"sample_{i}.nc", x[i], i % 3)
    (tmp_path / ".hidden").write_text("not data")
    paths = resolve(str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == [f"sample_{i}.nc" for i in range(6)]
    info, fs = describe_set(str(tmp_path), "climate/data", "climate/labels", one_sample=True)
    assert fs.n == 6 and tuple(info.x_shape) == (4, 5, 3)
    gx, gy = read_set(fs, "climate/data", "climate/labels", 0, 6, meta_of(info), fs.paths[0])
    assert np.array_equal(gx, x) and np.array_equal(gy, np.arange(6) % 3)
    src = SetSource(fs, "climate/data", "climate/labels", meta_of(info), fs.paths[0])
    bx, by = src.empty(3)
    src.read(np.array([1, 3, 5]), bx, by)
    assert np.array_equal(bx, x[[1, 3, 5]]) and np.array_equal(by, [1, 0, 2])
    src.close()
