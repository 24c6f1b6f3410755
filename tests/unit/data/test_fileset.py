"""Many HDF5 files as one data set: the FileSet math against a plain concatenation, the listing
of a directory or a glob, the start-up checks and their messages, and the readers (one file
at a time, for data.cache=memory and scatter; SetSource for data.cache=stream) on real files."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.data.files import Meta, check_files, describe_set, meta_of, resolve
from hpc_rlx.data.set_reader import read_set
from hpc_rlx.data.fileset import FileSet, first_difference, files_of_ranges, rank_pieces
from hpc_rlx.data.resolve import data_sources, label_classes
from hpc_rlx.data.set_source import SetSource
from hpc_rlx.data.stream import scan_rows
from hpc_rlx.base.errors import DataError


# ---- the math ------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", [(5,), (1, 1, 1, 1), (3, 1, 7, 2, 9), (10, 4)])
def test_a_set_maps_every_sample_like_one_concatenated_file(counts):
    fs = FileSet(tuple(f"f{i}" for i in range(len(counts))), counts)
    owner = [(f, j) for f, c in enumerate(counts) for j in range(c)]     # the concatenation
    assert fs.n == len(owner) and [fs.locate(i) for i in range(fs.n)] == owner
    rng = np.random.default_rng(0)
    for a in range(fs.n + 1):
        for b in range(a, fs.n + 1):
            got = [(p.file, p.lo + k, p.at + k) for p in fs.pieces(a, b) for k in range(p.hi - p.lo)]
            assert got == [(*owner[i], i - a) for i in range(a, b)]
            assert list(fs.files_in(a, b)) == sorted({owner[i][0] for i in range(a, b)})
    for _ in range(20):
        rows = np.sort(rng.choice(fs.n, size=rng.integers(1, fs.n + 1), replace=False))
        parts = fs.split(rows)
        assert np.concatenate([np.arange(a, b) for _, _, a, b in parts]).tolist() == list(range(len(rows)))
        assert [(f, int(j)) for f, loc, _, _ in parts for j in loc] == [owner[i] for i in rows]
    with pytest.raises(IndexError):
        fs.locate(fs.n)
    with pytest.raises(IndexError):
        fs.pieces(0, fs.n + 1)


def test_rank_pieces_and_a_remapped_set_read_the_same_samples_elsewhere():
    fs = FileSet(("/d/a.h5", "/d/b.h5", "/d/c.h5"), (4, 4, 4))
    assert rank_pieces(fs, 3, 9) == [("/d/a.h5", 3, 4), ("/d/b.h5", 0, 4), ("/d/c.h5", 0, 1)]
    assert files_of_ranges(fs, [(0, 2), (7, 9), (3, 3)]) == [0, 1, 2]
    staged = fs.remapped({"/d/b.h5": "/tmp/x/b.h5"})
    assert staged.opened(1) == "/tmp/x/b.h5" and staged.opened(0) == "/d/a.h5"
    assert staged.named(1) == "/tmp/x/b.h5 (a copy of /d/b.h5)"
    assert staged.record() == fs.record()       # the checkpoint's names are the originals'
    assert fs.remapped(lambda p: p.replace("/d/", "/s/")).opened(2) == "/s/c.h5"


def test_the_first_difference_of_two_file_lists_is_named():
    old = FileSet(("/d/f_0.h5", "/d/f_1.h5", "/d/f_2.h5"), (5, 5, 5)).record()
    assert old["names"] == ["f_0.h5", "f_1.h5", "f_2.h5"]
    assert first_difference(old, FileSet(("/e/f_0.h5", "/e/f_1.h5", "/e/f_2.h5"), (5, 5, 5)).record()) is None
    added = FileSet(("/d/f_0.h5", "/d/f_1.h5", "/d/f_2.h5", "/d/f_3.h5"), (5, 5, 5, 5)).record()
    assert first_difference(old, added) == "data.path has 1 more file(s), the first 'f_3.h5'"
    renamed = FileSet(("/d/f_0.h5", "/d/g_1.h5", "/d/f_2.h5"), (5, 5, 5)).record()
    assert first_difference(old, renamed) == "data.path's file 2 was 'f_1.h5', now 'g_1.h5'"
    resized = FileSet(("/d/f_0.h5", "/d/f_1.h5", "/d/f_2.h5"), (5, 6, 5)).record()
    assert first_difference(old, resized) == "data.path's file 'f_1.h5' held 5 samples, now 6"
    fewer = FileSet(("/d/f_0.h5", "/d/f_1.h5"), (5, 5)).record()
    assert first_difference(old, fewer) == "data.path has 1 file(s) fewer, the first missing 'f_2.h5'"


# ---- files on disk -------------------------------------------------------------------------------

def _one_sample_dir(d: Path, n: int, dtype=np.int16, shape=(2, 3), group: str = "climate") -> tuple:
    """n one-sample files (inputs `group/data`, a scalar integer label `group/labels`)."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    x = rng.integers(-300, 300, (n,) + shape).astype(dtype) if np.dtype(dtype).kind in "iu" \
        else rng.standard_normal((n,) + shape).astype(dtype)
    y = rng.integers(0, 4, n).astype(np.int64)
    for i in range(n):
        with h5py.File(d / f"s_{i}.h5", "w") as f:
            f[f"{group}/data"], f[f"{group}/labels"] = x[i], y[i]
    order = sorted(range(n), key=lambda i: f"s_{i}.h5")         # s_10 before s_2
    return x[order], y[order]


def _multi_files(d: Path, sizes, dtype=np.int32, shape=(3,)) -> tuple:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2)
    x = rng.integers(0, 1000, (sum(sizes),) + shape).astype(dtype)
    y = rng.integers(0, 3, sum(sizes)).astype(np.int64)
    a = 0
    for k, n in enumerate(sizes):
        with h5py.File(d / f"part_{k:02d}.h5", "w") as f:
            f["x"], f["y"] = x[a:a + n], y[a:a + n]
        a += n
    return x, y


def test_a_directory_lists_its_hdf5_files_sorted_as_strings_and_a_glob_picks_files(tmp_path):
    d = tmp_path / "set"
    _one_sample_dir(d, 12)
    with h5py.File(d / "z.nc", "w") as f:       # netCDF-4 is HDF5: counted by its signature
        f["climate/data"] = np.zeros((2, 3), np.int16)
    (d / "sub").mkdir()                          # not recursive
    (d / ".hidden").write_text("editor state")
    got = [os.path.basename(p) for p in resolve(str(d))]
    assert got == sorted([f"s_{i}.h5" for i in range(12)] + ["z.nc"])
    assert got[:4] == ["s_0.h5", "s_1.h5", "s_10.h5", "s_11.h5"]
    (d / "notes.txt").write_text("not data")
    with pytest.raises(DataError, match=r"notes\.txt' in that directory is not an HDF5 file.*glob"):
        resolve(str(d))
    assert [os.path.basename(p) for p in resolve(str(d / "s_1*.h5"))] == ["s_1.h5", "s_10.h5", "s_11.h5"]
    with pytest.raises(DataError, match=r"data.val_path=.*nothing_\*\.h5 matches no file"):
        resolve(str(d / "nothing_*.h5"), "data.val_path")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory with no files in it"):
        resolve(str(tmp_path / "empty"))


def test_the_start_up_checks_name_the_first_file_that_differs(tmp_path):
    d = tmp_path / "multi"
    _multi_files(d, [4, 7, 2, 5])
    info, fs = describe_set(str(d), "x", "y")
    assert fs.counts == (4, 7, 2, 5) and info.n == 18 and info.x_shape == (3,) and info.files is fs
    with h5py.File(d / "part_02.h5", "r+") as f:
        del f["x"]
        f["x"] = np.zeros((2, 4), np.int32)
    with pytest.raises(DataError, match=r"part_02\.h5' differs from .*part_00\.h5': input 'x' has per-sample "
                                        r"shape \(4,\) there, \(3,\)"):
        describe_set(str(d), "x", "y")
    with h5py.File(d / "part_02.h5", "r+") as f:
        del f["x"]
        f["x"] = np.zeros((2, 3), np.float32)
    with pytest.raises(DataError, match=r"part_02\.h5' differs .*input 'x' has dtype float32 there, int32"):
        describe_set(str(d), "x", "y")
    with h5py.File(d / "part_02.h5", "r+") as f:
        del f["x"]
    with pytest.raises(DataError, match=r"part_02\.h5' has no input dataset 'x'"):
        describe_set(str(d), "x", "y")
    # one sample a file: rank 0 describes the first; each rank checks the files it reads
    one = tmp_path / "one"
    _one_sample_dir(one, 6)
    info, fs = describe_set(str(one), "climate/data", "climate/labels", one_sample=True)
    assert fs.counts == (1,) * 6 and info.x_shape == (2, 3) and info.y_shape == ()
    with h5py.File(one / "s_4.h5", "r+") as f:
        del f["climate/labels"]
        f["climate/labels"] = np.zeros(2, np.int64)
    with pytest.raises(DataError, match=r"s_4\.h5' differs .*label 'climate/labels' has per-sample shape \(2,\)"):
        check_files(fs, range(6), "climate/data", "climate/labels", meta_of(info), fs.paths[0])
    check_files(fs, range(4), "climate/data", "climate/labels", meta_of(info), fs.paths[0])   # not s_4's


def test_validation_is_the_tail_of_the_files_and_another_set_must_hold_the_same_datasets(tmp_path):
    one = tmp_path / "one"
    _one_sample_dir(one, 10)
    d = {"path": str(one), "val_path": None, "val_fraction": 0.2, "x": "climate/data", "y": "climate/labels",
         "one_sample_per_file": True}
    src = data_sources(d)
    assert (src.n_train, src.val_start, src.val_stop) == (8, 8, 10)       # the last two files
    other = tmp_path / "val"
    _one_sample_dir(other, 3, dtype=np.int32)
    with pytest.raises(DataError, match=r"s_0\.h5' differs from .*input 'climate/data' has dtype int32 there"):
        data_sources(dict(d, val_path=str(other)))
    assert label_classes(src.files, "climate/labels", 8) == (int(max(_labels(one)[:8])) + 1, 8)


def _labels(d: Path) -> list:
    return [int(h5py.File(p, "r")["climate/labels"][()]) for p in resolve(str(d))]


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32])
def test_both_readers_return_the_concatenation_as_stored(tmp_path, dtype):
    x, y = _multi_files(tmp_path / "m", [3, 8, 1, 6], dtype=dtype)
    info, fs = describe_set(str(tmp_path / "m"), "x", "y")
    ref = meta_of(info)
    for a, b in ((0, 18), (2, 12), (11, 12), (5, 5)):
        gx, gy = read_set(fs, "x", "y", a, b, ref, fs.paths[0])
        assert gx.dtype == dtype and np.array_equal(gx, x[a:b]) and np.array_equal(gy, y[a:b])
    gx, _ = read_set(fs, "x", "y", 1, 17, ref, fs.paths[0], x_dtype=np.float64)    # cast while reading
    assert gx.dtype == np.float64 and np.array_equal(gx, x[1:17].astype(np.float64))
    src = SetSource(fs, "x", "y", ref, fs.paths[0])
    bx, by = src.empty(20)
    rows = np.array([0, 2, 3, 4, 10, 11, 12, 17])
    src.read(rows, bx, by, at=2)
    assert np.array_equal(bx[2:10], x[rows]) and np.array_equal(by[2:10], y[rows]) and bx.dtype == dtype
    src.read_range(1, 15, bx, by)
    assert np.array_equal(bx[:14], x[1:15])
    src.close()


def test_one_sample_files_read_by_offset_after_the_first_open_and_a_lost_file_is_named(tmp_path):
    one = tmp_path / "one"
    x, y = _one_sample_dir(one, 9, dtype=np.uint16)
    info, fs = describe_set(str(one), "climate/data", "climate/labels", one_sample=True)
    offsets: dict = {}
    src = SetSource(fs, "climate/data", "climate/labels", meta_of(info), fs.paths[0], offsets=offsets)
    src.check(0, 9)
    rows = np.array([1, 4, 5, 8])
    for _ in range(2):               # the second pass reads by the offsets the first recorded
        bx, by = src.empty(4)
        src.read(rows, bx, by)
        assert np.array_equal(bx, x[rows]) and np.array_equal(by, y[rows])
    assert offsets[fs.paths[0]] is not None      # the first file's, read through HDF5
    scan_rows(src, 0, 9, 4, False, None, 1 << 20)             # the labels in [0, 4)
    with pytest.raises(DataError, match=r"label 3 at row \d is outside \[0, 3\)"):
        scan_rows(src, 0, 9, 3, False, None, 1 << 20)
    os.truncate(fs.paths[5], 100)
    with pytest.raises(DataError, match=rf"{fs.paths[5]}"):
        src.read(rows, *src.empty(4))
    os.remove(fs.paths[8])
    with pytest.raises(DataError, match=rf"dataset file '{fs.paths[8]}' does not exist"):
        src.read(np.array([8]), *src.empty(1))
    src.close()
    with pytest.raises(DataError, match=rf"{fs.paths[8]}.* does not exist"):
        read_set(fs, "climate/data", "climate/labels", 7, 9, meta_of(info), fs.paths[0])


def test_a_set_read_from_copies_checks_each_copy_and_names_both(tmp_path):
    x, y = _multi_files(tmp_path / "m", [5, 5])
    info, fs = describe_set(str(tmp_path / "m"), "x", "y")
    copy = tmp_path / "copy.h5"
    with h5py.File(copy, "w") as f:
        f["x"], f["y"] = x[5:9], y[5:9]         # one sample short
    staged = fs.remapped({fs.paths[1]: str(copy)})
    gx, _ = read_set(staged, "x", "y", 0, 5, meta_of(info), fs.paths[0])
    assert np.array_equal(gx, x[:5])
    with pytest.raises(DataError, match=rf"'{copy} \(a copy of {fs.paths[1]}\)' holds 4 samples, 5 when"):
        read_set(staged, "x", "y", 0, 10, meta_of(info), fs.paths[0])
    assert isinstance(meta_of(info), Meta)


def test_one_sample_per_file_joins_the_fingerprint_only_when_set():
    from hpc_rlx.config.fingerprint import config_fingerprint
    cfg = {"data": {"path": "/d", "x": "x", "y": "y"}, "model": {"name": "mlp"}}
    plain = config_fingerprint(cfg)
    assert config_fingerprint({**cfg, "data": {**cfg["data"], "one_sample_per_file": False}}) == plain
    assert config_fingerprint({**cfg, "data": {**cfg["data"], "one_sample_per_file": True}}) != plain
    staged = {**cfg["data"], "stage_dir": "/dev/shm/x", "stage_keep": True}
    assert config_fingerprint({**cfg, "data": staged}) == plain


def test_a_resume_checks_the_training_files_and_not_a_separate_validation_set():
    from types import SimpleNamespace

    from hpc_rlx.checkpoint.data_files import check_data_files, data_files_record
    from hpc_rlx.base.errors import CheckpointError

    def plan(files, val_files=None):
        return SimpleNamespace(path="/d", val_path="/v" if val_files else "/d", files=files, val_files=val_files,
                               one_sample=False, n_train=10, val_stop=10, sample_shape=[3], x_dtype="float32",
                               y_shape=[], y_dtype="int64")
    saved = {"data_files": data_files_record(plan([["/d/a.h5", 4], ["/d/b.h5", 6]], [["/v/c.h5", 2]]))}
    check_data_files(saved, plan([["/e/a.h5", 4], ["/e/b.h5", 6]], [["/v/other.h5", 5]]), "ckpt.h5")
    check_data_files({}, plan([["/d/z.h5", 1]]), "old.h5")          # written before lists were kept
    with pytest.raises(CheckpointError, match=r"checkpoint ckpt.h5 was trained on other data files: data.path's "
                                              r"file 'b.h5' held 6 samples, now 7"):
        check_data_files(saved, plan([["/d/a.h5", 4], ["/d/b.h5", 7]]), "ckpt.h5")


def test_group_paths_in_one_file_and_the_info_command_and_doctor_over_a_directory(tmp_path, capsys):
    from hpc_rlx.data.__main__ import main
    from hpc_rlx.doctor.probe import data_file_problem
    one = tmp_path / "one.h5"
    with h5py.File(one, "w") as f:
        f["climate/data"], f["climate/labels_0"] = np.ones((5, 2, 2), np.float32), np.arange(5)
    info, fs = describe_set(str(one), "climate/data", "climate/labels_0")
    assert (info.n, info.x_shape, len(fs)) == (5, (2, 2), 1) and info.path == str(one)
    gx, gy = read_set(fs, "climate/data", "climate/labels_0", 1, 4, meta_of(info), str(one))
    assert gx.shape == (3, 2, 2) and gy.tolist() == [1, 2, 3]
    d = tmp_path / "vols"
    _one_sample_dir(d, 4)
    assert main(["info", str(d), "--x-name", "climate/data", "--y-name", "climate/labels",
                 "--one-sample-per-file"]) == 0
    out = capsys.readouterr().out
    assert "files: 4 (" in out and "one sample each" in out and "rows: 4" in out
    assert main(["info", str(d), "--x-name", "climate/data", "--y-name", "climate/labels"]) == 1
    assert "data.one_sample_per_file=true" in capsys.readouterr().err       # a scalar label says how
    assert data_file_problem(str(d)) is None and data_file_problem(str(d / "*.h5")) is None
    assert data_file_problem(str(d / "x_*.h5")) == "matches no file"
    (d / "notes.txt").write_text("")
    assert "notes.txt' in that directory is not an HDF5 file" in data_file_problem(str(d))
