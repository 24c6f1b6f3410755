"""`python -m hpc_rlx.data convert`: CSV and .npz files into the HDF5 layout hpc_rlx reads.

Real files in, real HDF5 files out, and a real training job on a converted file."""

from __future__ import annotations

import re
import subprocess

import h5py
import numpy as np
import pytest

from hpc_rlx.data import convert as cv
from hpc_rlx.data.hdf5 import describe, read_rows
from hpc_rlx.base.errors import ConfigError, DataError

from tests.support.jobs import PYTHON, REPO, explain, mpi_env, read_metrics, train_job


def _csv(path, text: str):
    path.write_text(text)
    return path


def _table(rows=120, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(rows) % 3
    x = rng.standard_normal((rows, 4)) + 3.0 * y[:, None]   # well separated: learnable in 3 epochs
    return x, y


def _write_table(path, x, y, header="a,b,c,d,species", delimiter=","):
    lines = [header] if header else []
    for xi, yi in zip(x, y):
        lines.append(delimiter.join([*(repr(float(v)) for v in xi), str(yi)]))
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(*args, timeout=60):
    return subprocess.run([PYTHON, "-m", "hpc_rlx.data", "convert", *map(str, args)], cwd=REPO,
                          env=mpi_env(), capture_output=True, text=True, timeout=timeout)


# ---- CSV -------------------------------------------------------------------------------------

def test_csv_becomes_chunked_compressed_x_and_y(tmp_path):
    x, y = _table()
    src = _write_table(tmp_path / "iris.csv", x, y)
    done = cv.convert(src, tmp_path / "iris.h5", "species")
    assert (done.rows, done.num_classes, done.columns) == (120, 3, ["a", "b", "c", "d"])
    info = describe(tmp_path / "iris.h5")
    assert (info.n, info.x_shape, str(info.x_dtype), info.y_shape, str(info.y_dtype)) == \
        (120, (4,), "float32", (), "int64")
    assert info.attrs["num_classes"] == 3 and info.attrs["label_column"] == "species"
    assert info.attrs["feature_names"] == ["a", "b", "c", "d"]
    with h5py.File(tmp_path / "iris.h5", "r") as f:
        for name in ("x", "y"):
            d = f[name]
            assert d.chunks is not None and d.chunks[1:] == d.shape[1:], "chunks must be whole rows"
            assert d.compression == "gzip"
    # a hyperslab read (what each rank does) gives exactly the CSV's rows
    xs, ys = read_rows(tmp_path / "iris.h5", "x", "y", 30, 75)
    np.testing.assert_allclose(xs, x[30:75].astype(np.float32))
    np.testing.assert_array_equal(ys, y[30:75])


def test_csv_larger_than_a_block_is_written_block_by_block(tmp_path, monkeypatch):
    monkeypatch.setattr(cv, "_CSV_BLOCK_ROWS", 7)
    x, y = _table(rows=50)
    src = _write_table(tmp_path / "big.csv", x, y)
    cv.convert(src, tmp_path / "big.h5", "species")
    xs, ys = read_rows(tmp_path / "big.h5", "x", "y", 0, 50)
    np.testing.assert_allclose(xs, x.astype(np.float32))
    np.testing.assert_array_equal(ys, y)


def test_csv_without_header_takes_the_label_by_number(tmp_path):
    x, y = _table(rows=12)
    src = _write_table(tmp_path / "plain.csv", x, y, header=None, delimiter=";")
    done = cv.convert(src, tmp_path / "plain.h5", "-1")
    assert done.rows == 12 and done.x_shape == (4,)
    xs, ys = read_rows(tmp_path / "plain.h5", "x", "y", 0, 12)
    np.testing.assert_array_equal(ys, y)
    with pytest.raises(DataError, match=r"no label column 'species'; columns: none \(no header row"):
        cv.convert(src, tmp_path / "other.h5", "species")


def test_tsv_and_float_labels_are_regression_targets(tmp_path):
    src = _csv(tmp_path / "r.tsv", "u\tv\ttarget\n1\t2\t0.5\n3\t4\t1.25\n5\t6\t-2\n")
    done = cv.convert(src, tmp_path / "r.h5", "target")
    assert done.num_classes is None and done.y_dtype == "float32"
    _, ys = read_rows(tmp_path / "r.h5", "x", "y", 0, 3)
    np.testing.assert_allclose(ys, [0.5, 1.25, -2.0])
    # whole-number targets stay floats with --regression
    src2 = _csv(tmp_path / "counts.csv", "u,count\n1,3\n2,7\n")
    assert cv.convert(src2, tmp_path / "c.h5", "count", regression=True).y_dtype == "float32"
    assert "num_classes" not in describe(tmp_path / "c.h5").attrs


@pytest.mark.parametrize("text, label, message", [
    ("", "y", r"is empty: no header and no data rows"),
    ("a,b,y\n", "y", r"has a header but no data rows"),
    ("a,b,y\n1,2,0\n", "label", r"has no label column 'label'; columns: a, b, y"),
    ("a,color,y\n1,red,0\n", "y", r"column 'color' of .* is not numeric \(line 2: 'red'\); every input column"),
    ("a,b,species\n1,2,setosa\n", "species", r"label column 'species' .* is not numeric \(line 2: 'setosa'\); "
                                             r"labels must be numbers"),
    ("a,b,y\n1,2,0\n3,4\n", "y", r"line 3 of .* has 2 fields, but the first row has 3"),
    ("a,b,y\n1,,0\n", "y", r"line 2 of .*: column 'b' is empty \(a missing value\)"),
    ("a,b,y\n1,2,-1\n3,4,1\n", "y", r"-1 is negative: class labels are 0 \.\. K-1"),
    ("a,b,y\n1,2,0\n3,4,0\n", "y", r"every label is 0"),
    ("a\n1\n", "a", r"has 1 column"),
])
def test_csv_errors_are_clear(tmp_path, text, label, message):
    src = _csv(tmp_path / "bad.csv", text)
    with pytest.raises(DataError, match=message):
        cv.convert(src, tmp_path / "bad.h5", label)
    assert not (tmp_path / "bad.h5").exists()
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file was left behind"


def test_csv_that_is_not_text(tmp_path):
    (tmp_path / "bin.csv").write_bytes(b"a,b,y\n1,2,0\n\xff\xfe\x00,3,1\n")
    with pytest.raises(DataError, match=r"is not UTF-8 text"):
        cv.convert(tmp_path / "bin.csv", tmp_path / "bin.h5", "y")
    assert not (tmp_path / "bin.h5").exists()


def test_existing_output_is_kept_unless_forced(tmp_path):
    x, y = _table(rows=9)
    src = _write_table(tmp_path / "t.csv", x, y)
    out = tmp_path / "t.h5"
    out.write_bytes(b"precious")
    with pytest.raises(DataError, match=r"already exists; pass --force to replace it"):
        cv.convert(src, out, "species")
    assert out.read_bytes() == b"precious"
    cv.convert(src, out, "species", force=True)
    assert describe(out).n == 9
    with pytest.raises(DataError, match=r"is the input file itself"):
        cv.convert(src, src, "species", force=True)


def test_bad_options(tmp_path):
    x, y = _table(rows=9)
    src = _write_table(tmp_path / "t.csv", x, y)
    with pytest.raises(DataError, match=r"does not exist"):
        cv.convert(tmp_path / "nope.csv", tmp_path / "o.h5", "species")
    (tmp_path / "t.xlsx").write_bytes(b"PK")
    with pytest.raises(DataError, match=r"convert reads \.csv, \.tsv, \.txt, \.npz files"):
        cv.convert(tmp_path / "t.xlsx", tmp_path / "o.h5", "species")
    with pytest.raises(ConfigError, match=r"--x names an array of an \.npz file"):
        cv.convert(src, tmp_path / "o.h5", "species", x="a")
    with pytest.raises(DataError, match=r"--num-classes 2, but .* has label 2"):
        cv.convert(src, tmp_path / "o.h5", "species", num_classes=2)
    assert cv.convert(src, tmp_path / "o.h5", "species", num_classes=5).num_classes == 5


# ---- .npz ------------------------------------------------------------------------------------

def test_npz_label_and_the_other_array(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.integers(0, 255, (40, 1, 8, 8)).astype(np.uint8)
    labels = (np.arange(40) % 4).astype(np.int32)
    np.savez(tmp_path / "img.npz", images=images, labels=labels)
    done = cv.convert(tmp_path / "img.npz", tmp_path / "img.h5", "labels")
    assert (done.x_shape, done.x_dtype, done.y_dtype, done.num_classes) == ((1, 8, 8), "uint8", "int64", 4)
    xs, ys = read_rows(tmp_path / "img.h5", "x", "y", 10, 20)
    np.testing.assert_array_equal(xs, images[10:20])
    np.testing.assert_array_equal(ys, labels[10:20])


def test_npz_with_more_arrays_needs_x(tmp_path):
    x = np.random.default_rng(0).standard_normal((20, 3))
    np.savez(tmp_path / "m.npz", x_train=x, y_train=np.arange(20) % 2, x_test=x[:5])
    with pytest.raises(DataError, match=r"holds 2 arrays besides 'y_train' \(x_train, x_test\); name the inputs with --x"):
        cv.convert(tmp_path / "m.npz", tmp_path / "m.h5", "y_train")
    done = cv.convert(tmp_path / "m.npz", tmp_path / "m.h5", "y_train", x="x_train")
    assert done.rows == 20 and done.x_dtype == "float32"
    with pytest.raises(DataError, match=r"no array 'labels' for --label; arrays: x_train, y_train, x_test"):
        cv.convert(tmp_path / "m.npz", tmp_path / "m2.h5", "labels")
    with pytest.raises(DataError, match=r"arrays 'x_test' and 'y_train' .* different lengths: 5 vs 20"):
        cv.convert(tmp_path / "m.npz", tmp_path / "m3.h5", "y_train", x="x_test")


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}, {"b": 2}], dtype=object), y=np.arange(2))
    with pytest.raises(DataError, match=r"cannot be read without pickle"):
        cv.convert(tmp_path / "obj.npz", tmp_path / "o.h5", "y")
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 3)), y=np.zeros((0,), dtype=np.int64))
    with pytest.raises(DataError, match=r"array 'x' in .* is empty"):
        cv.convert(tmp_path / "empty.npz", tmp_path / "o.h5", "y")
    (tmp_path / "fake.npz").write_text("not a zip")
    with pytest.raises(DataError, match=r"is not a readable \.npz file"):
        cv.convert(tmp_path / "fake.npz", tmp_path / "o.h5", "y")
    assert not (tmp_path / "o.h5").exists()


def test_damaged_npz_is_one_error_line_and_keeps_the_output(tmp_path):
    """An archive cut short (no zip directory) and one with a corrupt member (bad CRC): one
    `error:` line each, exit 1, and the existing output, even with --force, is left as it was."""
    x, y = _table(rows=40)
    np.savez(tmp_path / "good.npz", x=x, y=y)
    whole = (tmp_path / "good.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(whole[:len(whole) // 2])
    damaged = bytearray(whole)
    damaged[100] ^= 0xFF          # inside the first member's data: its CRC no longer matches
    (tmp_path / "corrupt.npz").write_bytes(bytes(damaged))
    out = tmp_path / "o.h5"
    out.write_bytes(b"an earlier conversion")
    for name, message in (("truncated.npz", r"is not a readable \.npz file \(File is not a zip file\)"),
                          ("corrupt.npz", r"array 'x' in .* is corrupt \(Bad CRC-32")):
        proc = cli(tmp_path / name, "--label", "y", "--out", out, "--force")
        assert proc.returncode == 1, explain(proc)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), explain(proc)
        assert re.search(message, lines[0]) and "again" in lines[0], lines[0]
        assert out.read_bytes() == b"an earlier conversion"


# ---- the command line and training on the result --------------------------------------------

def test_cli_converts_and_reports_errors_in_one_line(tmp_path):
    x, y = _table(rows=30)
    src = _write_table(tmp_path / "t.csv", x, y)
    proc = cli(src, "--label", "species", "--out", tmp_path / "t.h5")
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "30 rows" in proc.stdout and "data=file data.path=" in proc.stdout
    proc = cli(src, "--label", "species", "--out", tmp_path / "t.h5")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: output '{tmp_path / 't.h5'}' already exists; pass --force to replace it"]
    assert cli(src, "--label", "species", "--out", tmp_path / "t.h5", "--force").returncode == 0


@pytest.mark.mpi
def test_converted_files_train(tmp_path):
    x, y = _table(rows=200)
    src = _write_table(tmp_path / "t.csv", x, y)
    assert cli(src, "--label", "species", "--out", tmp_path / "t.h5").returncode == 0
    run = tmp_path / "run"
    proc = train_job(2, run, ["data=file", f"data.path={tmp_path / 't.h5'}", "train.epochs=3",
                              "train.batch_size=16", "model.hidden=[16]", "checkpoint=off"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    recs = read_metrics(run)
    assert len(recs) == 3 and recs[-1]["val_accuracy"] > 0.6, recs
    # an .npz of images trains with the CNN
    rng = np.random.default_rng(3)
    labels = np.arange(96) % 2
    images = rng.standard_normal((96, 1, 8, 8)).astype(np.float32) + labels[:, None, None, None]
    np.savez(tmp_path / "img.npz", images=images, labels=labels)
    assert cli(tmp_path / "img.npz", "--label", "labels", "--out", tmp_path / "img.h5").returncode == 0
    proc = train_job(2, tmp_path / "run2", ["data=file", f"data.path={tmp_path / 'img.h5'}", "model=cnn",
                                            "train.epochs=1", "train.batch_size=16", "checkpoint=off"],
                     timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert len(read_metrics(tmp_path / "run2")) == 1
