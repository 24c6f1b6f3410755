"""`comm.shared_memory`: the fused bucket summed in memory the ranks of a node share
(`hpc_rlx.comm.node_memory`), against MPI's Allreduce.

The pure pieces (how the bucket is cut among a node's ranks, the /dev/shm room check), then
real mpirun jobs: the sum over 2, 3 and 4 ranks for several steps (new values every step, tail
fields included), every rank holding the same bits and, on 2 ranks, MPI's bits; then training
runs: on by default for CPU lanes, the same model as MPI's path (bitwise on 2 ranks), and the
settings that keep MPI's Allreduce. Across emulated nodes: `tests/cluster/test_multihost.py`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.comm.node_memory import owned_parts, shm_shortfall

from tests.support.jobs import explain, launch_cmd, mpi_env, mpirun, train_job, with_private_dev_shm

NODE_SUM = Path(__file__).resolve().parents[2] / "support" / "mpi_scripts" / "node_sum.py"
EQUIV = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
         "model.hidden=[32,16]", "optim.lr=0.05", "checkpoint=off"]


@pytest.mark.parametrize("n,ranks", [(10, 3), (7, 4), (3, 4), (1_000_003, 8), (0, 2)])
def test_the_parts_tile_the_bucket_and_differ_by_at_most_one(n, ranks):
    parts = owned_parts(n, ranks)
    assert len(parts) == ranks and parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1


def test_room_in_dev_shm_is_measured_not_assumed(tmp_path):
    assert shm_shortfall(1024, str(tmp_path)) is None
    assert shm_shortfall(1 << 62, str(tmp_path / "missing")) is None    # nothing to measure: MPI decides
    why = shm_shortfall(1 << 62, str(tmp_path))                          # more than any disk holds
    assert why.startswith(f"{tmp_path} has ") and "MiB free" in why and "25% headroom" in why, why


def _own_dev_shm_job(size: str, run: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """A 2-rank training job over a real tmpfs of ``size`` on /dev/shm."""
    job = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", "report.plots=false"] + overrides)
    return subprocess.run(with_private_dev_shm(size, job), env=mpi_env(), capture_output=True, text=True,
                          timeout=180)


@pytest.mark.mpi
def test_a_dev_shm_too_small_for_the_bucket_falls_back_to_mpi_and_says_why(tmp_path, digits_h5):
    # 1.1 M float32 parameters: 8.6 MiB of segments for 2 ranks, 10.7 MiB with the headroom
    args = ["train.epochs=1", "checkpoint=off", f"data.path={digits_h5}", "model.hidden=[1024,1024]"]
    small = _own_dev_shm_job("6m", tmp_path / "small", args)
    assert small.returncode == 0, explain(small)        # no SIGBUS: the window was never made
    line = _path_line(small)
    assert "node shared memory" not in line and "shared-memory sum off: /dev/shm has" in line, line
    assert "MiB free, the node's segments need 10.7 MiB" in line, line
    roomy = _own_dev_shm_job("64m", tmp_path / "roomy", args)
    assert roomy.returncode == 0, explain(roomy)
    assert "path node shared memory (2 ranks)" in _path_line(roomy), _path_line(roomy)
    a, b = _params(tmp_path / "small"), _params(tmp_path / "roomy")
    assert all(np.array_equal(a[k], b[k]) for k in a)    # either path, the same float32 model


@pytest.mark.mpi
@pytest.mark.openmpi
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_shared_sum_is_the_sum_on_every_rank_step_after_step(tmp_path, ranks):
    out = tmp_path / "sum.json"
    # 100,003 float32 values in 0.1 MiB chunks: parts that do not fall on chunk or page borders
    proc = mpirun(ranks, [str(NODE_SUM), "100003", "4", "0.1", str(out)], timeout=120)
    assert proc.returncode == 0, explain(proc)
    got = json.loads(out.read_text())
    assert got["active"] and got["path"] == f"node shared memory ({ranks} ranks)", got
    assert got["max_rel_err"] < 1e-6, got
    assert got["same_on_every_rank"], got
    # two ranks: a + b is b + a, so MPI's sum has the same bits; more ranks add in another order
    if ranks == 2:
        assert got["equal_to_mpi"], got
    for step, tail in enumerate(got["tails"]):
        assert tail["samples"] == ranks * (ranks + 1) / 2
        assert tail["loss_sum"] == pytest.approx(sum(0.5 * (r + step) for r in range(ranks)))
        assert tail["rate"] == [10.0 + r for r in range(ranks)]
    assert got["kept_after_release"], got
    # one shared bucket per process at a time: sharing another moves the first back to MPI
    assert got["first_left_for_the_second"] and got["first_still_sums"], got


def _params(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _path_line(proc) -> str:
    return next(line for line in proc.stdout.splitlines() if "bucket on host, path" in line)


@pytest.mark.mpi
def test_training_uses_it_by_default_and_ends_where_mpi_does(tmp_path, digits_h5):
    base = ["train.epochs=2", "checkpoint=off", f"data.path={digits_h5}"]
    on = train_job(2, tmp_path / "on", base + ["trace.enabled=true"])
    off = train_job(2, tmp_path / "off", base + ["comm.shared_memory=false"])
    assert on.returncode == 0 and off.returncode == 0, explain(on) + explain(off)
    assert "node shared memory (2 ranks)" in _path_line(on), _path_line(on)
    assert "node shared memory" not in _path_line(off), _path_line(off)
    a, b = _params(tmp_path / "on"), _params(tmp_path / "off")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)   # float32, bitwise
    # the trace names the path of every step's sum
    events = json.loads((tmp_path / "on" / "trace.json").read_text())["traceEvents"]
    paths = {e["args"]["path"] for e in events if e.get("name") == "allreduce" and e.get("ph") == "X"}
    assert paths == {"node shared memory (2 ranks)"}, paths


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["sync", "async"])
def test_three_ranks_match_mpi_and_repeat_bitwise(tmp_path, digits_h5, policy):
    base = EQUIV + [f"data.path={digits_h5}", f"policy={policy}"]
    for name, extra in (("a", []), ("b", []), ("mpi", ["comm.shared_memory=false"])):
        proc = train_job(3, tmp_path / name, base + extra)
        assert proc.returncode == 0, explain(proc)
    a, b, mpi = (_params(tmp_path / name) for name in ("a", "b", "mpi"))
    assert all(np.array_equal(a[k], b[k]) for k in a)          # a fixed order of additions
    worst = max(float(np.abs(a[k] - mpi[k]).max() / np.abs(mpi[k]).max()) for k in a)
    assert worst <= 1e-10, worst


@pytest.mark.mpi
@pytest.mark.parametrize("extra,why", [
    (["comm.deterministic=true"], "ordered sum"),
    (["comm.wire_dtype=bfloat16"], "16-bit wire"),
    (["comm.overlap=true"], "overlap"),
])
def test_the_settings_that_keep_mpi_allreduce(tmp_path, digits_h5, extra, why):
    proc = train_job(2, tmp_path / "run", ["train.epochs=1", "checkpoint=off", f"data.path={digits_h5}"] + extra)
    assert proc.returncode == 0, explain(proc)
    assert "node shared memory" not in _path_line(proc), f"{why}: {_path_line(proc)}"
    assert f"shared-memory sum off: {extra[0]}" in _path_line(proc), _path_line(proc)


@pytest.mark.mpi
def test_one_rank_has_nothing_to_share(tmp_path, digits_h5):
    proc = train_job(1, tmp_path / "run", ["train.epochs=1", "checkpoint=off", f"data.path={digits_h5}"])
    assert proc.returncode == 0, explain(proc)
    assert "node shared memory" not in _path_line(proc), _path_line(proc)
    assert "shared-memory sum off" not in _path_line(proc), _path_line(proc)     # nothing to say

