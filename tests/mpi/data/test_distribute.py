"""load_shard under real mpirun: 'read' and 'scatter' give every rank the same rows, and
failures raise the same DataError on every rank instead of hanging."""

import json
import os
import socket
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.data.distribute import load_shard, round_rows
from hpc_rlx.base.errors import ConfigError, DataError

from tests.support.jobs import launch_cmd

# the module's fixture runs its jobs once: its tests keep to one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("distribute-jobs")

REPO = Path(__file__).resolve().parents[3]
HOST = socket.gethostname().split(".")[0]   # a read failure names the failing rank's host
SCRIPT = REPO / "tests" / "support" / "mpi_scripts" / "data_load_shard.py"
N = 50


def _write(path, x, y, x_name="x", y_name="y"):
    with h5py.File(path, "w") as f:
        f.create_dataset(x_name, data=x)
        f.create_dataset(y_name, data=y)


def _files(d: Path):
    rng = np.random.default_rng(0)
    img = d / "img.h5"
    _write(img, rng.standard_normal((N, 3, 2)).astype(np.float32), rng.integers(0, 5, N))
    tok = d / "tok.h5"
    _write(tok, rng.integers(0, 90, (N, 7)), rng.integers(0, 90, (N, 7)), "inputs/ids", "inputs/next")
    big_endian = d / "be.h5"
    _write(big_endian, rng.standard_normal((N, 4)).astype(">f8"), rng.integers(0, 3, N).astype(">i4"))
    return {"img": img, "tok": tok, "be": big_endian}


def _cases(files, nranks):
    rest = N - 10 * (nranks - 1)
    uneven = [(0, 10), (10, 10), (10, 37), (37, N)] if nranks == 4 else [(0, 13), (13, N)]
    overlap = [(20, 30), (0, 25), (5, 5), (40, N)][:nranks]
    even = [(10 * r, 10 * r + 10) for r in range(nranks - 1)] + [(N - rest, N)]
    ok = []
    for mode in ("read", "scatter"):
        extra = {"forbid_open_nonroot": True} if mode == "scatter" else {}
        ok += [
            dict(name=f"uneven_{mode}", mode=mode, path=str(files["img"]), bounds=uneven, **extra),
            dict(name=f"overlap_{mode}", mode=mode, path=str(files["img"]), bounds=overlap, **extra),
            dict(name=f"tok_{mode}", mode=mode, path=str(files["tok"]), bounds=even,
                 x_name="inputs/ids", y_name="inputs/next", **extra),
            dict(name=f"be_{mode}", mode=mode, path=str(files["be"]), bounds=even, **extra),
            dict(name=f"empty_{mode}", mode=mode, path=str(files["img"]), bounds=[(3, 3)] * nranks, **extra),
        ]
    # many rounds: by the byte budget, and by a lowered C-int limit (3 rows/rank/round)
    ok += [
        dict(name="chunks_scatter", mode="scatter", path=str(files["img"]), bounds=uneven, chunk_bytes=200,
             forbid_open_nonroot=True),
        dict(name="intmax_scatter", mode="scatter", path=str(files["img"]), bounds=uneven,
             int_max=6 * nranks * 3, forbid_open_nonroot=True),
    ]
    missing = str(files["img"].parent / "nope.h5")
    beyond = [(0, 10)] * (nranks - 1) + [(40, N + 5)]
    bad = [
        dict(name="missing_read", mode="read", path=missing, bounds=even),
        dict(name="missing_scatter", mode="scatter", path=missing, bounds=even, forbid_open_nonroot=True),
        dict(name="noy_scatter", mode="scatter", path=str(files["img"]), y_name="labels", bounds=even,
             forbid_open_nonroot=True),
        dict(name="beyond_read", mode="read", path=str(files["img"]), bounds=beyond),
        dict(name="beyond_scatter", mode="scatter", path=str(files["img"]), bounds=beyond, forbid_open_nonroot=True),
        # rank 0's disk fails after a few rounds, when data has already gone out
        dict(name="diskfail_scatter", mode="scatter", path=str(files["img"]), bounds=uneven, chunk_bytes=200,
             fail_read_after=5, forbid_open_nonroot=True),
    ]
    for c in ok + bad:
        c.setdefault("x_name", "x")
        c.setdefault("y_name", "y")
    return ok, bad


def _run_job(tmp: Path, nranks: int):
    files = _files(tmp)
    ok, bad = _cases(files, nranks)
    job = tmp / "job.json"
    job.write_text(json.dumps(ok + bad))
    out = tmp / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        launch_cmd(nranks, [str(SCRIPT), str(job), str(out)]),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ok, bad, out


@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def job(request, tmp_path_factory):
    nranks = request.param
    ok, bad, out = _run_job(tmp_path_factory.mktemp(f"shard{nranks}"), nranks)
    return nranks, {c["name"]: c for c in ok}, {c["name"]: c for c in bad}, out


def _truth(case, r):
    a, b = case["bounds"][r]
    with h5py.File(case["path"], "r") as f:
        return f[case["x_name"]][a:b], f[case["y_name"]][a:b]


@pytest.mark.mpi
def test_every_rank_gets_exactly_its_rows(job):
    nranks, ok, _, out = job
    for name, case in ok.items():
        for r in range(nranks):
            base = out / f"{name}.r{r}"
            assert not Path(str(base) + ".err").exists(), (name, Path(str(base) + ".err").read_text())
            x = np.load(str(base) + ".x.npy")
            y = np.load(str(base) + ".y.npy")
            tx, ty = _truth(case, r)
            a, b = case["bounds"][r]
            assert x.shape == (b - a,) + tx.shape[1:], name
            assert x.dtype == tx.dtype.newbyteorder("=") and x.dtype.isnative, name
            assert y.dtype == ty.dtype.newbyteorder("=") and y.dtype.isnative, name
            np.testing.assert_array_equal(x, tx, err_msg=name)
            np.testing.assert_array_equal(y, ty, err_msg=name)


@pytest.mark.mpi
def test_read_and_scatter_agree(job):
    nranks, ok, _, out = job
    pairs = [n[: -len("_read")] for n in ok if n.endswith("_read")]
    assert len(pairs) >= 4
    for stem in pairs:
        for r in range(nranks):
            for part in ("x", "y"):
                a = np.load(out / f"{stem}_read.r{r}.{part}.npy")
                b = np.load(out / f"{stem}_scatter.r{r}.{part}.npy")
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
    # the chunked scatters match the one-round one
    for name in ("chunks_scatter", "intmax_scatter"):
        for r in range(nranks):
            np.testing.assert_array_equal(
                np.load(out / f"{name}.r{r}.x.npy"), np.load(out / f"uneven_scatter.r{r}.x.npy")
            )


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name,needles",
    [
        ("missing_read", ["reading", "nope.h5", "does not exist", f"rank 0 on {HOST} and"]),
        ("missing_scatter", ["scattering", "nope.h5", "does not exist", "rank 0"]),
        ("noy_scatter", ["no label dataset 'labels'", "['x', 'y']"]),
        ("beyond_read", ["row range [40, 55)", "50 rows"]),
        ("beyond_scatter", ["[40, 55)", "50 rows"]),
        ("diskfail_scatter", ["simulated disk failure", "rank 0"]),
    ],
)
def test_failures_raise_same_error_everywhere(job, name, needles):
    nranks, _, bad, out = job
    msgs = []
    for r in range(nranks):
        err = out / f"{name}.r{r}.err"
        assert err.exists(), f"rank {r} did not raise for {name}"
        msgs.append(err.read_text())
        assert not (out / f"{name}.r{r}.x.npy").exists()
    assert len(set(msgs)) == 1, msgs
    for needle in needles:
        assert needle in msgs[0], msgs[0]
    if name == "beyond_read":
        assert f"rank {nranks - 1}" in msgs[0]  # names the rank whose range was bad


def test_round_rows_bounds():
    # byte budget: 4 ranks x 100 B rows into 10 kB -> 25 rows each
    assert round_rows(4, 100, 10, 10_000) == 25
    # C-int limit: 8 ranks of 2**24-element rows cannot take more than 15 rows per round
    cap = round_rows(8, 4 * 2**24, 2**24, 1 << 62)
    assert cap == 15 and 8 * cap * 2**24 <= 2**31 - 1
    assert round_rows(4, 100, 10, 1) == 1  # always progresses
    with pytest.raises(DataError, match="use mode 'read'"):
        round_rows(4, 4 * 2**30, 2**30, 1 << 62)


class _OneRank:
    """Just enough of a communicator for a single-process call."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]

    def bcast(self, obj, root=0):
        return obj


def test_single_process_read_and_bad_arguments(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.arange(6)
    _write(tmp_path / "d.h5", x, y)
    gx, gy = load_shard(_OneRank(), "read", tmp_path / "d.h5", "x", "y", [(2, 5)])
    np.testing.assert_array_equal(gx, x[2:5])
    np.testing.assert_array_equal(gy, y[2:5])
    with pytest.raises(ConfigError, match="unknown data distribution mode 'push'"):
        load_shard(_OneRank(), "push", tmp_path / "d.h5", "x", "y", [(0, 6)])
    with pytest.raises(ValueError, match="2 bounds for 1 ranks"):
        load_shard(_OneRank(), "read", tmp_path / "d.h5", "x", "y", [(0, 3), (3, 6)])
    with pytest.raises(DataError, match="row range \\[4, 9\\).*6 rows"):
        load_shard(_OneRank(), "read", tmp_path / "d.h5", "x", "y", [(4, 9)])
