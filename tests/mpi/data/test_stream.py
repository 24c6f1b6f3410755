"""`data.cache=stream`: the window math, the reader and its ring (no MPI), and real mpirun jobs
that train bitwise as `data.cache=memory` does (read and scatter, 1 and 2 ranks, shuffled,
uneven rows, integer images cast per batch, a float64 file in a float32 run), a resume in the
middle of a window, and a run under a cgroup memory limit below the file's size (which
data.cache=memory refuses: tests/mpi/data/test_shard_memory.py)."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.data import hdf5
from hpc_rlx.data.hdf5 import check_values, read_rows
from hpc_rlx.data.plan import EpochOrder, plan_shards, window_of, window_steps
from hpc_rlx.data.stream import Prefetcher, RowSource, Slot, scan_rows
from hpc_rlx.base.errors import DataError

from tests.support.jobs import REPO, explain, launch_cmd, mpi_env, read_metrics, train_job
from tests.support.memory_limit import memory_limit_or_skip


# ---- pure math: windows reproduce the plan's steps ---------------------------------------------

@pytest.mark.parametrize("n,batch,world,leftover", [(103, 8, 3, "partial"), (103, 8, 2, "drop"),
                                                    (1437, 32, 1, "drop"), (70, 7, 2, "partial")])
@pytest.mark.parametrize("shuffle", [True, False])
def test_windows_hold_exactly_the_samples_of_their_steps(n, batch, world, leftover, shuffle):
    plan = plan_shards(n, batch, world, leftover)
    for w in (1, 3, plan.steps_per_epoch):
        for rank in range(world):
            order = EpochOrder(plan, rank, epoch=2, seed=5, shuffle=shuffle)
            seen = []
            for start in range(0, plan.steps_per_epoch, w):
                win = order.window(start, min(start + w, plan.steps_per_epoch))
                assert np.all(np.diff(win.rows) > 0)           # sorted, each row once
                for s in range(win.start, win.stop):
                    assert np.array_equal(win.rows[win.positions(s)], order.step_indices(s))
                    assert window_of(s, plan.steps_per_epoch, w) == (win.start, win.stop)
                seen.extend(win.rows.tolist())
            assert sorted(seen) == sorted(i for s in range(plan.steps_per_epoch) for i in order.step_indices(s))


def test_the_order_table_is_compact():
    plan = plan_shards(100_000, 64, 2, "drop")
    order = EpochOrder(plan, 0, 0, 1)
    assert order.cols.dtype == np.uint16 and order.cols.nbytes == 2 * 32 * plan.steps_per_epoch


def test_window_steps_bounds():
    assert window_steps(1000, step_bytes=1 << 20, budget_bytes=8 << 20) == 8
    assert window_steps(1000, step_bytes=100, budget_bytes=8 << 20) == 125       # an eighth of the epoch
    assert window_steps(5, step_bytes=1 << 30, budget_bytes=8 << 20) == 1         # one step at least
    assert window_steps(1, step_bytes=1, budget_bytes=8 << 20) == 1


# ---- the reader ---------------------------------------------------------------------------------

def _file(path: Path, n: int = 300, dtype=np.float32, shape=(3, 4), seed: int = 0, layout: str = "contiguous") -> Path:
    """layout: contiguous (read by pread), chunked (gzip, as `convert` writes: read by HDF5),
    or big-endian (contiguous, but HDF5 must swap the bytes)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 255, (n,) + shape) if np.dtype(dtype).kind == "u" else rng.standard_normal((n,) + shape)
    x, y = x.astype(dtype), rng.integers(0, 5, n).astype(np.int64)
    with h5py.File(path, "w") as f:
        if layout == "chunked":
            f.create_dataset("x", data=x, chunks=(16,) + shape, compression="gzip", shuffle=True)
            f.create_dataset("y", data=y, chunks=(64,), compression="gzip")
        elif layout == "big-endian":
            f["x"], f["y"] = x.astype(x.dtype.newbyteorder(">")), y.astype(">i8")
        else:
            f["x"], f["y"] = x, y
    return path


@pytest.mark.parametrize("layout", ["contiguous", "chunked", "big-endian"])
def test_row_source_reads_sorted_rows_runs_and_ranges(tmp_path, monkeypatch, layout):
    path = _file(tmp_path / "d.h5", layout=layout)
    with h5py.File(path, "r") as f:
        x, y = f["x"][()], f["y"][()]
    monkeypatch.setattr("hpc_rlx.data.stream._PIECE_BYTES", 7 * 56)      # several pieces
    src = RowSource(path, "x", "y")
    assert (src._fd is not None) == (layout == "contiguous")
    rows = np.array([0, 1, 2, 3, 9, 10, 50, 51, 52, 53, 54, 55, 56, 57, 120, 299])
    bx, by = src.empty(40)
    src.read(rows, bx, by, at=3)
    assert np.array_equal(bx[3:3 + len(rows)], x[rows]) and np.array_equal(by[3:3 + len(rows)], y[rows])
    src.read_range(17, 45, bx, by)
    assert np.array_equal(bx[:28], x[17:45]) and np.array_equal(by[:28], y[17:45])
    src.close()


def test_decode_factor_tells_compressed_chunks_from_plain_bytes(tmp_path):
    plain = RowSource(_file(tmp_path / "a.h5"), "x", "y")
    packed = RowSource(_file(tmp_path / "b.h5", layout="chunked"), "x", "y")   # chunks of 16 rows
    assert plain.decode_factor(20, 300) == 1.0
    assert packed.decode_factor(20, 300) > 10          # 20 rows spread over 19 chunks
    assert packed.decode_factor(300, 300) == pytest.approx(1.0, abs=0.05)
    plain.close()
    packed.close()


def test_read_rows_casts_through_a_bounded_buffer(tmp_path, monkeypatch):
    path = _file(tmp_path / "d.h5", dtype=np.float64)
    monkeypatch.setattr(hdf5, "_CAST_BYTES", 5 * 96)
    x, y = read_rows(path, "x", "y", 10, 77, x_dtype=np.float32)
    with h5py.File(path, "r") as f:
        assert x.dtype == np.float32 and np.array_equal(x, f["x"][10:77].astype(np.float32))


def test_prefetcher_reads_ahead_in_order_and_never_more_than_the_ring():
    filled, in_use, peak = [], set(), [0]
    lock = threading.Lock()

    def fill(source, job, slot):
        with lock:
            in_use.add(id(slot))
            peak[0] = max(peak[0], len(in_use))
        slot.x[0] = job
        filled.append(job)
        return job * 10

    slots = [Slot(np.zeros(1), np.zeros(1)) for _ in range(3)]
    pre = Prefetcher(iter(range(20)), fill, slots)
    got = []
    while (slot := pre.next()) is not None:
        got.append((slot.job, slot.info, int(slot.x[0])))
        with lock:
            in_use.discard(id(slot))
        pre.release(slot)
    pre.close()
    assert got == [(j, j * 10, j) for j in range(20)] and peak[0] <= 3


def test_prefetcher_errors_come_out_of_next_and_close_stops_a_waiting_reader():
    def fill(source, job, slot):
        if job == 2:
            raise OSError("disk gone")
    pre = Prefetcher(iter(range(5)), fill, [Slot(None, None) for _ in range(3)])
    assert pre.next().job == 0 and pre.next().job == 1
    with pytest.raises(DataError, match="disk gone"):
        pre.next()
    pre.close()
    endless = Prefetcher(iter(int, 1), lambda s, j, slot: None, [Slot(None, None)])   # blocks on the ring
    endless.next()
    endless.close()
    assert not endless._thread.is_alive()


def test_scan_rows_finds_what_check_values_finds(tmp_path):
    path = _file(tmp_path / "d.h5", n=100)
    with h5py.File(path, "a") as f:
        f["y"][63] = 9
        f["x"][80, 1, 2] = np.nan
    src = RowSource(path, "x", "y")
    with pytest.raises(DataError, match=r"label 9 at row 63 is outside \[0, 5\)"):
        scan_rows(src, 0, 100, 5, False, None, block_bytes=10 * 56)
    scan_rows(src, 0, 60, 5, True, None, block_bytes=10 * 56)
    with pytest.raises(DataError, match="input row 80 contains a non-finite value"):
        scan_rows(src, 64, 100, 5, True, None, block_bytes=10 * 56)
    src.close()


def test_token_ids_are_checked_in_blocks(monkeypatch):
    monkeypatch.setattr(hdf5, "_SCAN_ELEMS", 8)
    x = np.arange(40, dtype=np.int64).reshape(10, 4) % 7
    vocab = hdf5.TokenVocab(7, "tok.weight")
    check_values(x, np.zeros((10, 4), np.int64), 7, False, vocab=vocab)
    x[6, 2] = 7
    with pytest.raises(DataError, match=r"input token id 7 at row 16 is outside the vocabulary \[0, 7\) "
                                        r"of the embedding 'tok.weight'"):
        check_values(x, np.zeros((10, 4), np.int64), 7, False, first_row=10, vocab=vocab)


# ---- real jobs: stream trains bitwise as memory ------------------------------------------------

def _params(run_dir: Path) -> dict:
    with h5py.File(run_dir / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _assert_same_training(a: Path, b: Path) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert np.array_equal(pa[k], pb[k]), k
    va = [(r["train_loss"], r["val_loss"]) for r in read_metrics(a)]
    vb = [(r["train_loss"], r["val_loss"]) for r in read_metrics(b)]
    assert va == vb


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """uint8 images (cast per batch; chunked and compressed: HDF5 reads them) and a float64
    file (cast while loading in memory mode; contiguous: read with pread)."""
    d = tmp_path_factory.mktemp("stream")
    return {"uint8": _file(d / "img.h5", n=460, dtype=np.uint8, shape=(1, 6, 6), seed=1, layout="chunked"),
            "float64": _file(d / "f64.h5", n=460, dtype=np.float64, shape=(1, 6, 6), seed=2)}


SMALL = ["data=file", "model=mlp", "model.hidden=[16]", "train.epochs=2", "train.batch_size=7",
         "data.leftover=partial", "data.shuffle=true", "checkpoint=off", "optim.lr=0.01"]


@pytest.mark.mpi
@pytest.mark.openmpi         # Iscatterv rounds and the reader thread under both MPIs
@pytest.mark.parametrize("n,kind", [(1, "float64"), (2, "uint8")])
def test_stream_trains_bitwise_as_memory_with_read_and_scatter(tmp_path, image_files, n, kind):
    base = SMALL + [f"data.path={image_files[kind]}"]
    ref = tmp_path / "memory"
    proc = train_job(n, ref, base)
    assert proc.returncode == 0, explain(proc)
    for dist in ("read", "scatter"):
        run = tmp_path / f"stream_{dist}"
        proc = train_job(n, run, base + ["data.cache=stream", f"data.distribution={dist}"])
        assert proc.returncode == 0, f"{dist}: " + explain(proc)
        _assert_same_training(ref, run)
        ranks = json.loads((run / "summary.json").read_text())["ranks"]
        assert [r["data_cache"] for r in ranks] == ["stream"] * n
        # every row once over the ranks (training shard and validation slice), as stored
        row_bytes = 36 * np.dtype(kind).itemsize + 8
        assert sum(r["shard_bytes"] for r in ranks) == 460 * row_bytes
        assert all(r["peak_rss_bytes"] > r["buffer_bytes"] > 0 for r in ranks)


@pytest.mark.mpi
def test_stream_with_scatter_refuses_ranks_that_step_apart(tmp_path, image_files):
    proc = train_job(2, tmp_path / "run", SMALL + [f"data.path={image_files['uint8']}", "data.cache=stream",
                                                   "data.distribution=scatter", "policy=async"], timeout=60)
    assert proc.returncode == 2 and "use data.distribution=read with data.cache=stream" in proc.stderr, explain(proc)


@pytest.mark.mpi
@pytest.mark.slow
def test_stream_windowed_policy_and_a_resume_mid_window(tmp_path, image_files):
    base = SMALL + [f"data.path={image_files['uint8']}"]
    fixed_k = ["policy=async", "policy.anchor=5", "policy.max_anchor=5", "policy.overhead_target=0.000001",
               "policy.divergence_threshold=null"]
    proc = train_job(2, tmp_path / "async_memory", base + fixed_k)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(2, tmp_path / "async_stream", base + fixed_k + ["data.cache=stream"])
    assert proc.returncode == 0, explain(proc)
    _assert_same_training(tmp_path / "async_memory", tmp_path / "async_stream")
    # sync, stopped at step 23 of 53 (inside the window [21, 28)), resumed with stream from its
    # checkpoint: the reader starts in the middle of a window
    ckpt = [x for x in base if x != "checkpoint=off"]
    proc = train_job(2, tmp_path / "whole", ckpt)
    assert proc.returncode == 0, explain(proc)
    for dist in ("read", "scatter"):
        run = tmp_path / f"resumed_{dist}"
        stream = ["data.cache=stream", f"data.distribution={dist}"]
        proc = train_job(2, run, ckpt + stream + ["train.max_steps=23"])
        assert proc.returncode == 0, explain(proc)
        proc = train_job(2, run, ckpt + stream)
        assert proc.returncode == 0, explain(proc)
        assert json.loads((run / "summary.json").read_text())["resumed_from"], dist
        pa, pb = _params(tmp_path / "whole"), _params(run)
        assert all(np.array_equal(pa[k], pb[k]) for k in pa), dist


# ---- under a memory limit below the file's size ----------------------------------------------

def _big_images(path: Path, rows: int) -> Path:
    """rows x 3x32x32 uint8 (3 KiB a sample), written in blocks."""
    rng = np.random.default_rng(7)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (rows, 3, 32, 32), dtype=np.uint8)
        for a in range(0, rows, 8192):
            b = min(rows, a + 8192)
            x[a:b] = rng.integers(0, 256, (b - a, 3, 32, 32), dtype=np.uint8)
        f["y"] = rng.integers(0, 10, rows).astype(np.int64)
        f.attrs["num_classes"] = 10
    return path


@pytest.mark.mpi
def test_stream_trains_under_a_memory_limit_below_the_file_size(tmp_path):
    limit = 240 << 20
    probe = memory_limit_or_skip(limit)
    data = _big_images(tmp_path / "big.h5", rows=110_000)          # 330 MiB of images
    assert data.stat().st_size > limit * 1.3
    base = ["data=file", f"data.path={data}", "model=mlp", "model.hidden=[16]", "train.batch_size=64",
            "train.epochs=1", "train.max_steps=40", "checkpoint=off", "optim.lr=0.0001", "data.val_fraction=0.05"]
    proc = train_job(1, tmp_path / "memory", base, timeout=120)         # no limit
    assert proc.returncode == 0, explain(proc)

    def limited(run: str, extra: list[str]) -> subprocess.CompletedProcess:
        cmd = launch_cmd(1, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / run}", "report.plots=false"] + base + extra)
        with probe as lim:
            proc = subprocess.run(lim.wrap(cmd), cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=120)
            proc.peak, proc.oom = lim.peak_bytes(), lim.oom_killed()
        return proc

    proc = limited("stream", ["data.cache=stream"])
    assert proc.returncode == 0, explain(proc)
    assert proc.peak is None or proc.peak <= limit
    _assert_same_training(tmp_path / "memory", tmp_path / "stream")
    proc = limited("memory_limited", [])      # the limit holds: memory mode is refused before it reads
    assert proc.returncode == 2 and not proc.oom, explain(proc)
    assert "data.cache=stream trains the same file" in proc.stderr, explain(proc)
