"""Across emulated hosts (tests/support/netns_cluster.py): real nodes with their own network, hostname,
IPC and scratch directory, launched over an ssh wrapper by MPICH's hydra or, with
HPC_RLX_MPI=openmpi, by Open MPI's mpirun.

Skipped with the reason where namespaces cannot be made (not root); with HPC_RLX_REQUIRE_NETNS=1
(CI) they must run."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import REPO, write_small_classification
from tests.support.mpi_launch import MPI_IMPL, MPIRUN, PYTHON
from tests.support.netns_cluster import SCRATCH, EmulatedCluster, can_emulate

pytestmark = [pytest.mark.mpi, pytest.mark.multihost, pytest.mark.openmpi, pytest.mark.xdist_group("multihost")]

MPI_NAME = {"mpich": "MPICH", "openmpi": "Open MPI"}[MPI_IMPL]


def launcher(cluster: EmulatedCluster, hosts: dict, args: list[str]) -> list[str]:
    """The selected MPI's launcher across `hosts`, started on node1."""
    if MPI_IMPL == "openmpi":
        return cluster.openmpi_cmd(MPIRUN, hosts, args)
    return cluster.mpich_cmd(str(Path(PYTHON).with_name("mpiexec")), hosts, args)
# 160 training rows, global batch 16: 10 steps per epoch on any world size
BASE = ["data=file", "data.val_fraction=0.2", "train.batch_size=16", "model.hidden=[16]",
        "report.plots=false", "train.progress=lines"]
EQUIV = ["train.dtype=float64", "train.epochs=2", "optim.lr=0.05", "checkpoint=off"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = can_emulate()
    if why:
        if os.environ.get("HPC_RLX_REQUIRE_NETNS") == "1":
            pytest.fail(f"HPC_RLX_REQUIRE_NETNS=1 but the emulated cluster cannot start: {why}")
        pytest.skip(why)
    with EmulatedCluster(3, tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def shared_h5(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("mh") / "small.h5", rows=200, seed=5)


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    e.pop("SLURM_JOB_ID", None)
    return e


def job(cluster: EmulatedCluster, hosts: dict, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """The launcher started on node1 across `hosts` ({'node1': ranks, ...}), with a timeout."""
    cmd = launcher(cluster, hosts, [PYTHON] + args)
    try:
        return cluster.on("node1", cmd, timeout=timeout, env=env(), cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n{e.stdout}\n{e.stderr}")


def train(cluster, hosts, run_dir, overrides, timeout=120):
    return job(cluster, hosts, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}"] + BASE + overrides, timeout)


def explain(p: subprocess.CompletedProcess) -> str:
    return f"rc={p.returncode}\n--- stdout ---\n{p.stdout[-3000:]}\n--- stderr ---\n{p.stderr[-3000:]}"


def params(run_dir: Path) -> dict:
    with h5py.File(Path(run_dir) / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def max_rel_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k])) / max(np.max(np.abs(a[k])), 1e-300)) for k in a)


# --------------------------------------------------------------------------------------
# Training across nodes
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_training_across_two_and_three_nodes_equals_one_node(cluster, shared_h5, tmp_path):
    base = EQUIV + [f"data.path={shared_h5}"]
    ref = tmp_path / "one-node"
    p = train(cluster, {"node1": 1}, ref, base)
    assert p.returncode == 0, explain(p)
    # how the bucket is summed (comm.shared_memory): within each node in shared memory, then
    # across nodes, where every node has the same number (> 1) of ranks; MPI's Allreduce else,
    # and the start-up line says why
    paths = {"node1x1_node2x1": "path host (no GPU lane on this rank); shared-memory sum off: "
                                "one rank on its node",
             "node1x1_node2x1_node3x1": "shared-memory sum off: one rank on its node",
             "node1x2_node2x2": "path node shared memory (2 ranks per node), MPI across 2 nodes",
             "node1x2_node2x1": "path host (no GPU lane on this rank); shared-memory sum off: "
                                "rank 2: one rank on its node"}
    for hosts in ({"node1": 1, "node2": 1}, {"node1": 2, "node2": 2}, {"node1": 1, "node2": 1, "node3": 1},
                  {"node1": 2, "node2": 1}):
        name = "_".join(f"{h}x{n}" for h, n in hosts.items())
        p = train(cluster, hosts, tmp_path / name, base)
        assert p.returncode == 0, f"{name}: " + explain(p)
        assert paths[name] in p.stdout, f"{name}: " + explain(p)
        diff = max_rel_diff(params(ref), params(tmp_path / name))
        assert diff <= 1e-10, f"{name}: max relative parameter difference {diff:.3e}"


@pytest.mark.slow
def test_one_copy_of_the_parameters_per_node_across_nodes_equals_one_node(cluster, shared_h5, tmp_path):
    """comm.node_shared_params with comm.shard=optimizer on 2 nodes of 2 + 1 and 2 + 2 ranks: the
    nodes' first ranks exchange their nodes' slices, and the run ends where one rank's whole-state
    run ends; each node's first rank alone reports the parameter bytes. Without shared
    parameters, 2 nodes of 2 reduce-scatter in each node's shared memory and across the nodes
    by columns (comm/node_scatter.py), and every rank holds the parameters."""
    base = EQUIV + [f"data.path={shared_h5}", "optim=adamw", "optim.lr=0.003"]
    ref = tmp_path / "one-rank"
    p = train(cluster, {"node1": 1}, ref, base)
    assert p.returncode == 0, explain(p)
    shared = ["comm.shard=optimizer", "comm.node_shared_params=true"]
    for hosts, extra, leaders, path in (
            ({"node1": 2, "node2": 1}, shared, [0, 2], "shared-memory sum off: rank 2: one rank on its node"),
            ({"node1": 2, "node2": 2}, shared, [0, 2], "reduce-scatter across 2 nodes"),
            ({"node1": 2, "node2": 2}, shared[:1], [0, 1, 2, 3],
             "path node shared memory (2 ranks per node), reduce-scatter across 2 nodes"),
            ({"node1": 2, "node2": 2}, shared[:1] + ["comm.deterministic=true"], [0, 1, 2, 3],
             "shared-memory sum off: comm.deterministic=true across 2 nodes")):
        name = "_".join(f"{h}x{n}" for h, n in hosts.items()) + f"_{len(extra)}"
        p = train(cluster, hosts, tmp_path / name, base + extra)
        assert p.returncode == 0, f"{name}: " + explain(p)
        assert path in p.stdout, f"{name}: " + explain(p)
        diff = max_rel_diff(params(ref), params(tmp_path / name))
        assert diff <= 1e-10, f"{name}: max relative parameter difference {diff:.3e}"
        ranks = json.loads((tmp_path / name / "summary.json").read_text())["ranks"]
        held = [r for r, rec in enumerate(ranks) if rec["param_bytes"] > 0]
        assert held == leaders, f"{name}: {ranks}"
        # one copy per node, the whole model's; the optimizer state once over all the ranks
        (one,) = json.loads((ref / "summary.json").read_text())["ranks"]
        assert all(ranks[r]["param_bytes"] == one["param_bytes"] for r in leaders), f"{name}: {ranks}"
        assert sum(rec["optimizer_bytes"] for rec in ranks) == one["optimizer_bytes"], f"{name}: {ranks}"


def one_sample_files(root: Path, count: int = 40) -> Path:
    """A directory of one-sample files: with 40, 32 training (rows of 2, 8 a rank on 2 ranks)
    and 8 validation (4 a rank)."""
    root.mkdir()
    rng = np.random.default_rng(3)
    for i in range(count):
        with h5py.File(root / f"s_{i:02d}.h5", "w") as f:
            f["x"] = rng.standard_normal(6).astype(np.float32)
            f["y"] = np.int64(rng.integers(0, 3))
    return root


@pytest.mark.skipif(MPI_IMPL == "openmpi", reason="CI time: the MPICH pass runs it, the Open MPI pass the "
                                                 "staged dead-rank case below")
def test_each_node_stages_its_own_ranks_files_and_trains_as_unstaged(cluster, tmp_path):
    """data.stage_dir on each node's private scratch, 2 nodes of 1 rank: node1 copies the files
    of rank 0's block and validation slice, node2 those of rank 1, and the run equals the
    unstaged one bitwise. data.stage_keep=true leaves the copies to look at."""
    from hpc_rlx.data.stage_plan import staged_name
    samples = one_sample_files(tmp_path / "samples")
    names = sorted(str(p) for p in samples.iterdir())
    base = EQUIV + [f"data.path={samples}", "data.one_sample_per_file=true", "model.num_classes=3"]
    hosts = {"node1": 1, "node2": 1}
    p = train(cluster, hosts, tmp_path / "plain", base)
    assert p.returncode == 0, explain(p)
    p = train(cluster, hosts, tmp_path / "staged", base + [f"data.stage_dir={SCRATCH}/stage", "data.stage_keep=true"])
    assert p.returncode == 0, explain(p)
    assert re.search(r"staged 40 file\(s\), [\d.]+ KiB, to data.stage_dir=\S+ on 2 node\(s\)", p.stdout), explain(p)
    mine = {"node1": names[:16] + names[32:36], "node2": names[16:32] + names[36:]}
    for node, want in mine.items():
        (kept,) = (cluster.scratch(node) / "stage").glob("hpc_rlx-stage-*")
        assert sorted(q.name for q in kept.iterdir()) == sorted(staged_name(n) for n in want), node
    a, b = params(tmp_path / "plain"), params(tmp_path / "staged")
    assert all(np.array_equal(a[k], b[k]) for k in a), max_rel_diff(a, b)


LAUNCHED_BY = {"mpich": "MPICH mpirun / mpiexec (hydra)", "openmpi": "Open MPI mpirun (prterun)"}[MPI_IMPL]


@pytest.mark.parametrize("hosts, rows", [
    ({"node1": 2, "node2": 2}, [r"node1\s+0-1\s+2\b", r"node2\s+2-3\s+2\b"]),
    ({"node1": 1, "node2": 1, "node3": 1}, [r"node1\s+0\s+1\b", r"node2\s+1\s+1\b", r"node3\s+2\s+1\b"]),
], ids=["2x2", "3x1"])
def test_doctor_reports_the_nodes_the_mpi_and_the_launcher(cluster, tmp_path, hosts, rows):
    p = job(cluster, hosts, ["-m", "hpc_rlx.doctor", f"hydra.run.dir={tmp_path}/run"])
    assert p.returncode == 0, explain(p)
    out = p.stdout
    assert f"{sum(hosts.values())} rank(s) on {len(hosts)} node(s)" in out, explain(p)
    assert all(re.search(row, out) for row in rows), explain(p)
    assert re.search(rf"library\s+{MPI_NAME}", out), explain(p)
    assert re.search(rf"launched by\s+{re.escape(LAUNCHED_BY)}", out), explain(p)
    assert "\x00" not in out and "\x1b" not in out, repr(out[-500:])


# --------------------------------------------------------------------------------------
# No shared filesystem
# --------------------------------------------------------------------------------------

@pytest.fixture
def data_on_node1_only(cluster):
    """The data file in node1's private scratch: at SCRATCH/small.h5 on node1 only."""
    path = write_small_classification(cluster.scratch("node1") / "small.h5", rows=200, seed=5)
    yield f"{SCRATCH}/small.h5"
    path.unlink(missing_ok=True)


def test_without_a_shared_filesystem_scatter_trains_and_read_names_the_rank_and_host(
        cluster, data_on_node1_only, shared_h5, tmp_path):
    hosts = {"node1": 1, "node2": 1}
    base = EQUIV + [f"data.path={data_on_node1_only}"]
    p = train(cluster, hosts, tmp_path / "scatter", base + ["data.distribution=scatter"])
    assert p.returncode == 0, explain(p)
    ref = tmp_path / "shared"
    assert train(cluster, hosts, ref, EQUIV + [f"data.path={shared_h5}"]).returncode == 0
    assert max_rel_diff(params(ref), params(tmp_path / "scatter")) <= 1e-10

    t0 = time.monotonic()
    p = train(cluster, hosts, tmp_path / "read", base + ["data.distribution=read"], timeout=60)
    assert p.returncode == 2, explain(p)
    assert time.monotonic() - t0 < 50
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(p)
    assert "failed on rank 1 on node2" in errors[0], errors[0]
    assert "data.distribution=scatter" in errors[0], errors[0]


@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_rank_0_lost_while_it_scatters_a_file_only_its_node_reads_ends_the_job_with_one_line(
        cluster, data_on_node1_only, tmp_path):
    """comm.on_failure=shrink with data.distribution=scatter from node1's private scratch: rank 0
    dies at step 5; the survivors' rank 0 on node2 cannot read the file, so no survivor can send
    the rows: one RankFailure line naming why, exit 2, no hang."""
    cmd = launcher(cluster, {"node1": 1, "node2": 2}, [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}"]
                   + BASE + EQUIV + [f"data.path={data_on_node1_only}", "data.distribution=scatter",
                                     "comm.on_failure=shrink", "debug.fail_rank=0", "debug.fail_point=step",
                                     "debug.fail_step=5", "debug.fail_mode=kill"])
    at = cmd.index(MPIRUN)
    p = cluster.on("node1", cmd[:at + 1] + ["--with-ft", "ulfm"] + cmd[at + 1:], timeout=120, env=env(), cwd=REPO)
    assert p.returncode == 2, explain(p)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, explain(p)
    assert re.search(r"\(RankFailure, .*\): rank 0 on node1 failed at step 5: rank 0 read the data and sent each "
                     r"rank its rows \(data\.distribution=scatter\), and the survivors' rank 0 on node2 cannot "
                     r"read .*small\.h5, so no survivor can send them", errors[0]), errors[0]


def test_a_run_directory_only_node1_sees_warns_and_checkpoints_still_resume(
        cluster, data_on_node1_only, tmp_path):
    hosts = {"node1": 1, "node2": 1}
    run = f"{SCRATCH}/run-private"
    p = job(cluster, hosts, ["-m", "hpc_rlx.doctor", f"hydra.run.dir={run}"])
    assert p.returncode == 0, explain(p)
    assert "the run directory is not shared" in p.stdout, explain(p)

    base = [f"data.path={data_on_node1_only}", "data.distribution=scatter", "train.epochs=2",
            "train.dtype=float64", "checkpoint.every_steps=5"]
    p = train(cluster, hosts, run, base + ["train.max_steps=5"])
    assert p.returncode == 0, explain(p)
    node1_run = cluster.scratch("node1") / "run-private"
    assert any((node1_run / "checkpoints").glob("ckpt-*.h5")), explain(p)
    node2_run = cluster.scratch("node2") / "run-private"
    assert not node2_run.exists() or not any(node2_run.rglob("*")), "a rank on node2 wrote files"
    p = train(cluster, hosts, run, base)
    assert p.returncode == 0, explain(p)
    assert "resumed from" in p.stdout, explain(p)
    assert json.loads((node1_run / "summary.json").read_text())["steps"] == 20

    ref = tmp_path / "uninterrupted"
    p = train(cluster, hosts, ref, base)
    assert p.returncode == 0, explain(p)
    with h5py.File(node1_run / "model.h5", "r") as f:
        resumed = {k: f[k][...] for k in f.keys()}
    assert max_rel_diff(params(ref), resumed) <= 1e-10


# --------------------------------------------------------------------------------------
# Faults across nodes: nothing hangs
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_h5(tmp_path_factory) -> Path:
    return write_small_classification(tmp_path_factory.mktemp("mhlong") / "long.h5", rows=4000, seed=2)


def start_training(cluster, hosts, run_dir, overrides) -> subprocess.Popen:
    cmd = launcher(cluster, hosts, [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}"] + BASE + overrides)
    return cluster.popen_on("node1", cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_first_epoch(proc, run_dir: Path, timeout: float = 90) -> None:
    metrics = Path(run_dir) / "metrics.jsonl"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.2)
    done = finish(proc, 5, None)
    pytest.fail(f"the job did not finish an epoch in {timeout}s (rc {proc.returncode})\n"
                f"{(done.stdout or '')[-3000:]}\n{(done.stderr or '')[-3000:]}")


def finish(proc, timeout: float, cluster: EmulatedCluster | None = None):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        if cluster is not None:
            cluster.kill_everything()      # daemons in sessions of their own hold the pipes
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the job did not end within {timeout}s\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_a_network_cut_to_node2_ends_the_job_calling_its_ranks_unreachable(cluster, long_h5, tmp_path):
    run = tmp_path / "cut"
    proc = start_training(cluster, {"node1": 1, "node2": 1}, run,
                          [f"data.path={long_h5}", "train.epochs=200", "comm.stall_warning_s=2",
                           "comm.stall_abort_s=20"])
    try:
        wait_for_first_epoch(proc, run)
        cluster.link("node2", up=False)
        t0 = time.monotonic()
        p = finish(proc, 60, cluster)
        elapsed = time.monotonic() - t0
    finally:
        cluster.link("node2", up=True)
    assert elapsed < 60, f"{elapsed:.0f} s after the cut"
    assert re.search(r"rank 1 on node2: silent: no heartbeat for \d+\.\d s; unreachable: no rank on "
                     r"node2 is heard \(network cut or node down\)", p.stderr), explain(p)
    if MPI_IMPL == "openmpi" and "lost communication with a remote daemon" in p.stderr:
        # PRRTE's keepalive found the daemon gone first and ended the job itself; its mpirun
        # then exits 0 (Open MPI's choice, documented in the README)
        return
    assert p.returncode != 0, explain(p)
    assert "aborting all 2 ranks" in p.stderr, explain(p)


def _pids_on(cluster, node: str, name: str = "python") -> list[int]:
    """Processes called `name` on `node`."""
    pids = []
    for pid in cluster.processes_on(node):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith(name):
                pids.append(pid)
        except OSError:
            continue
    return pids


@pytest.mark.slow
def test_all_ranks_of_node2_killed_ends_the_job_and_node1_alone_continues(cluster, long_h5, tmp_path):
    run = tmp_path / "killed"
    base = [f"data.path={long_h5}", "train.epochs=8", "checkpoint.every_steps=100",
            "comm.stall_warning_s=2"]
    # the killed run 30x slower (sleeps only): epochs of 0.05 s on a fast machine would end it
    # before the kill lands; it is killed after its first epoch, so only that one costs time
    proc = start_training(cluster, {"node1": 1, "node2": 2}, run,
                          base + ["debug.slowdown={0:30.0,1:30.0,2:30.0}"])
    wait_for_first_epoch(proc, run)
    victims = _pids_on(cluster, "node2")
    assert len(victims) == 2, victims
    for pid in victims:
        os.kill(pid, 9)
    t0 = time.monotonic()
    p = finish(proc, 60, cluster)
    assert p.returncode != 0 and time.monotonic() - t0 < 60, explain(p)
    saved = sorted(int(f.stem.split("-")[1]) for f in (run / "checkpoints").glob("ckpt-*.h5"))
    assert saved, explain(p)

    p = train(cluster, {"node1": 2}, run, base, timeout=180)
    assert p.returncode == 0, explain(p)
    assert re.search(rf"resumed from .*ckpt-0*{saved[-1]}\.h5", p.stdout), explain(p)
    assert json.loads((run / "summary.json").read_text())["steps"] == 8 * 200   # 3200 rows, global batch 16


@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_both_ranks_of_node2_killed_the_rank_on_node1_shrinks_and_trains_on(cluster, shared_h5, tmp_path):
    """comm.on_failure=shrink across 2 emulated nodes: both ranks of node2 SIGKILL themselves
    before their forward of step 5; the rank on node1 learns it from its Allreduce, shrinks and
    trains on alone, ending within 1e-10 of 3 ranks to that step resumed on 1 (node2's PRRTE daemon
    stays up: a daemon lost with its node ends the job, docs/reliability.md); the reference
    resumes at the record's step (4 where the survivor saw step 4's Allreduce fail). With Open MPI's
    hierarchical collectives (coll/han, which hpc_rlx switches off under ULFM) the survivor's
    Allreduce of step 5 returned a wrong sum instead of the failure: step 6 and 0.04 apart."""
    base = EQUIV + [f"data.path={shared_h5}", "comm.on_failure=shrink"]
    run = tmp_path / "shrunk"
    cmd = launcher(cluster, {"node1": 1, "node2": 2}, [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}"] + BASE + base
                   + ["debug.fail_rank=[1,2]", "debug.fail_point=step", "debug.fail_step=5", "debug.fail_mode=kill"])
    at = cmd.index(MPIRUN)
    p = cluster.on("node1", cmd[:at + 1] + ["--with-ft", "ulfm"] + cmd[at + 1:], timeout=120, env=env(), cwd=REPO)
    assert p.returncode == 0, explain(p)
    (failure,) = json.loads((run / "summary.json").read_text())["failures"]
    # ULFM reports a failure unevenly: node2's ranks may have completed step 4's Allreduce that
    # node1's rank then saw fail, and the survivor goes on from the state it holds (step 4)
    step = failure["step"]
    assert failure["ranks"] == [1, 2] and failure["hosts"] == ["node2", "node2"] and step in (4, 5), failure
    assert re.search(rf"ranks 1 on node2, 2 on node2 failed: 1 of 3 ranks train on from step {step}", p.stdout), \
        explain(p)
    ref, saved = tmp_path / "reference", [e for e in EQUIV if e != "checkpoint=off"] + [f"data.path={shared_h5}"]
    p = train(cluster, {"node1": 1, "node2": 2}, ref, saved + [f"train.max_steps={step}"])
    assert p.returncode == 0, explain(p)
    p = train(cluster, {"node1": 1}, ref, saved)
    assert p.returncode == 0 and "resumed from" in p.stdout, explain(p)
    diff = max_rel_diff(params(ref), params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e}"


@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_a_shard_moved_to_a_node_that_did_not_stage_it_is_read_in_place(cluster, tmp_path):
    """comm.on_failure=shrink with data.stage_dir, 1 rank on each of 2 nodes: node2's rank dies at
    step 3, and node1's takes every row. The files of node2's old block were staged on node2
    only, so node1's rank reads them from data.path: half its files from its node's copies,
    half in place. Its copies go at the end; node2's, whose only rank was SIGKILLed, stay."""
    samples = one_sample_files(tmp_path / "samples")
    run = tmp_path / "shrunk"
    cmd = launcher(cluster, {"node1": 1, "node2": 1}, [PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run}"] + BASE + EQUIV
                   + [f"data.path={samples}", "data.one_sample_per_file=true", "model.num_classes=3",
                      f"data.stage_dir={SCRATCH}/stage-moved", "comm.on_failure=shrink", "debug.fail_rank=[1]",
                      "debug.fail_point=step", "debug.fail_step=3", "debug.fail_mode=kill"])
    at = cmd.index(MPIRUN)
    p = cluster.on("node1", cmd[:at + 1] + ["--with-ft", "ulfm"] + cmd[at + 1:], timeout=120, env=env(), cwd=REPO)
    assert p.returncode == 0, explain(p)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and [f["ranks"] for f in summary["failures"]] == [[1]], summary
    (survivor,) = summary["ranks"]
    assert (survivor["staged_reads"], survivor["in_place_reads"]) == (20, 20), survivor
    assert list((cluster.scratch("node1") / "stage-moved").iterdir()) == []
    (left,) = (cluster.scratch("node2") / "stage-moved").glob("hpc_rlx-stage-*")
    assert len(list(left.iterdir())) == 20


# --------------------------------------------------------------------------------------
# The watchdog's side channel across hosts
# --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_flood_from_other_hosts_changes_nothing_and_rank_0_listens_on_one_address(
        cluster, long_h5, tmp_path):
    from tests.support.udp_flood import udp_sockets

    hosts = {"node1": 1, "node2": 1}
    # a stall report at 3 s: the flood must cause none, while a busy CI machine may hold an
    # honest step for over a second
    base = [f"data.path={long_h5}", "train.epochs=20", "comm.stall_warning_s=3",
            "comm.deterministic=true", "checkpoint=off"]
    calm = train(cluster, hosts, tmp_path / "calm", base)
    assert calm.returncode == 0, explain(calm)

    run = tmp_path / "flooded"
    # the flooded job's ranks 20x slower than they can be (sleeps only: the numbers are those
    # of the unslowed calm run), so it outlasts the capture and the flood on a fast machine
    proc = start_training(cluster, hosts, run, base + ["debug.slowdown={0:20.0,1:20.0}"])
    sockets: set = set()
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < 60:
        # rank 0's socket: the one bound in node1 to node1's address, not 0.0.0.0
        sockets = {(a, p) for a, p in udp_sockets(proc.pid) if a == cluster.addr["node1"]}
        if sockets:
            break
        time.sleep(0.1)
    assert sockets, f"no UDP socket bound to node1's address: {udp_sockets(proc.pid)}"
    assert not any(a == "0.0.0.0" for a, _ in udp_sockets(proc.pid))
    ports = ",".join(str(p) for _, p in sockets)
    # genuine heartbeats captured on node1, then replayed from node3 (a stranger's address)
    # and from node2 (the very address rank 1 sends from), beside forged and malformed ones
    captured = tmp_path / "captured.hex"
    cap = cluster.on("node1", [PYTHON, "-m", "tests.support.udp_flood", "capture", ports.split(",")[0], "1",
                               str(captured)], timeout=60, cwd=REPO)
    assert cap.returncode == 0 and captured.read_text().strip(), cap.stderr
    floods = [cluster.popen_on(node, [PYTHON, "-m", "tests.support.udp_flood", "flood", cluster.addr["node1"], ports,
                                      "2", "90", str(captured)], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
              for node in ("node3", "node2")]
    time.sleep(1.0)
    assert proc.poll() is None, "the job ended before the flood began: make it longer"
    p = finish(proc, 120, cluster)
    sent = {}
    for f in floods:                       # flooding until the job ended
        f.terminate()
        out, err = f.communicate(timeout=30)
        assert f.returncode == 0, err
        for k, v in json.loads(out).items():
            sent[k] = sent.get(k, 0) + v
    assert p.returncode == 0, explain(p)
    assert sum(sent.values()) > 100 and sent.get("replay", 0) > 0, sent
    assert max_rel_diff(params(tmp_path / "calm"), params(run)) == 0.0
    dropped = json.loads((run / "summary.json").read_text())["watchdog"]["dropped"]
    for reason in ("foreign_sender", "malformed", "oversized", "replay", "bad_mac"):
        assert dropped.get(reason, 0) > 0, (dropped, sent)
    assert "STALL" not in p.stderr and "FORGED" not in p.stdout + p.stderr, explain(p)


@pytest.mark.slow
def test_a_genuine_stall_across_hosts_still_aborts_while_another_host_floods(cluster, long_h5, tmp_path):
    from tests.support.udp_flood import udp_sockets

    run = tmp_path / "stalled"
    proc = start_training(cluster, {"node1": 1, "node2": 1}, run,
                          [f"data.path={long_h5}", "train.epochs=3", "comm.stall_warning_s=1",
                           "comm.stall_abort_s=5", "checkpoint=off", "debug.stall_rank=1",
                           "debug.stall_step=100", "debug.stall_s=120"])
    ports: set = set()
    t0 = time.monotonic()
    while proc.poll() is None and not ports and time.monotonic() - t0 < 60:
        ports = {p for a, p in udp_sockets(proc.pid) if a == cluster.addr["node1"]}
        time.sleep(0.1)
    assert ports, f"no UDP socket bound to node1's address: {udp_sockets(proc.pid)}"
    # forged, malformed and oversized datagrams from node3 for at most 60 s, or until the job ends
    flood = cluster.popen_on("node3", [PYTHON, "-m", "tests.support.udp_flood", "flood", cluster.addr["node1"],
                                       ",".join(map(str, ports)), "2", "60"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    p = finish(proc, 90, cluster)
    elapsed = time.monotonic() - t0
    flooding = flood.poll() is None
    flood.terminate()
    out, err = flood.communicate(timeout=30)
    assert flood.returncode == 0, err
    assert flooding, "the flood had ended before the job did"
    assert sum(json.loads(out).values()) > 0, out
    assert p.returncode != 0 and elapsed < 60, explain(p)
    assert "at step 100" in p.stderr and "not arrived (1/2): ranks 1" in p.stderr, explain(p)
    assert re.search(r"stalled for \d+\.\d s >= comm\.stall_abort_s=5: aborting all 2 ranks", p.stderr), explain(p)
    assert "FORGED" not in p.stdout + p.stderr, explain(p)


@pytest.mark.slow
def test_heartbeats_that_cannot_reach_rank_0_are_reported_as_such(cluster, long_h5, tmp_path):
    """node1 resolves its own name to an address only it has (a classic /etc/hosts slip), so
    rank 0's watchdog listens where node2 cannot send; MPI itself is unaffected. Both sides say
    so once, and the job trains to the end."""
    with EmulatedCluster(2, tmp_path / "cluster", net=78,
                         private_self_address={"node1": "10.99.0.1"}) as slipped:
        p = train(slipped, {"node1": 1, "node2": 1}, tmp_path / "oneway",
                  # rank 1 arrives 7 s late at step 50 (a sleep): the job outlasts the 5 s after
                  # which both sides speak however fast the machine (3 epochs take 0.15 s
                  # there), and rank 0's stall report has to say why it cannot hear rank 1
                  [f"data.path={long_h5}", "train.epochs=3", "comm.stall_warning_s=1", "checkpoint=off",
                   "debug.stall_rank=1", "debug.stall_step=50", "debug.stall_s=7"],
                  timeout=240)
    assert p.returncode == 0, explain(p)
    text = p.stdout + p.stderr
    assert "at step 50" in text and "not arrived (1/2): ranks 1" in text, explain(p)
    assert re.search(r"rank 1 on node2: heartbeats cannot reach rank 0: none has arrived at its "
                     r"watchdog at 10\.99\.0\.1:\d+", text), explain(p)
    assert "never reported" not in text, explain(p)
    assert text.count("has not answered") == 1, explain(p)
    assert "rank 1 on node2: rank 0's stall watchdog at 10.99.0.1:" in text, explain(p)
    assert re.search(r"no heartbeat from rank\(s\) 1 on node2 has reached rank 0's stall watchdog at "
                     r"10\.99\.0\.1:", text), explain(p)


@pytest.mark.slow
def test_a_rank_0_whose_name_resolves_to_loopback_is_still_reached(long_h5, tmp_path):
    """Debian's `127.0.1.1 node1` line on node1: rank 0 listens where node2 reaches it."""
    with EmulatedCluster(2, tmp_path / "cluster", net=79,
                         private_self_address={"node1": "127.0.1.1"}) as debianish:
        # rank 1 arrives 7 s late at step 50 (a sleep): the job outlasts the 5 s after which
        # either side would warn, however fast the machine, and rank 0's stall report shows
        # what rank 1's heartbeats told it
        p = train(debianish, {"node1": 1, "node2": 1}, tmp_path / "run",
                  [f"data.path={long_h5}", "train.epochs=3", "comm.stall_warning_s=1", "checkpoint=off",
                   "debug.stall_rank=1", "debug.stall_step=50", "debug.stall_s=7"], timeout=240)
    assert p.returncode == 0, explain(p)
    text = p.stdout + p.stderr
    assert "not arrived (1/2): ranks 1" in text, explain(p)
    assert "rank 1 on node2: busy outside any collective at step 50" in text, explain(p)
    assert "has not answered" not in text and "no heartbeat from rank" not in text, explain(p)


@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="ULFM: Open MPI 5's mpirun --with-ft ulfm")
def test_a_node_lost_with_its_daemon_ends_train_sh_with_one_line_not_status_0(cluster, long_h5, tmp_path):
    """`slurm/train.sh comm.on_failure=shrink` across 2 emulated nodes (mpirun on node1, given
    the hosts by a wrapper as a site's mpirun would be): node2's ranks and its PRRTE daemon are
    SIGKILLed, as a node that loses power. Open MPI tears the whole job down (a daemon's loss is
    not survived) and exits 0 ("lost communication with a remote daemon") or, on its other path
    ("a daemon failed to report back"), with the daemon's status 137; after a 0 train.sh sees no
    summary.json and ends with its one line and status 3: never a success."""
    hosts = {"node1": 1, "node2": 2}
    cmd = cluster.openmpi_cmd(MPIRUN, hosts, [])
    at = cmd.index("-n")
    del cmd[at:at + 2]                      # train.sh gives -n (and --with-ft ulfm) itself
    wrapper = tmp_path / "mpirun"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(c) for c in cmd) + ' "$@"\n')
    wrapper.chmod(0o755)
    run = tmp_path / "lost"
    args = ["bash", str(REPO / "slurm" / "train.sh"), f"hydra.run.dir={run}", *BASE, f"data.path={long_h5}",
            "train.epochs=8", "comm.on_failure=shrink", "debug.slowdown={0:30.0,1:30.0,2:30.0}"]
    e = dict(env(), HPC_RLX_MPIRUN=str(wrapper), HPC_RLX_NTASKS="3", HPC_RLX_VENV=str(Path(PYTHON).parent.parent))
    proc = cluster.popen_on("node1", args, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_first_epoch(proc, run)
    victims = cluster.processes_on("node2")
    daemons = [pid for pid in victims if _pids_on(cluster, "node2", "prted").count(pid)]
    assert daemons and len(_pids_on(cluster, "node2")) == 2, victims
    for pid in _pids_on(cluster, "node2") + daemons:
        os.kill(pid, 9)
    p = finish(proc, 90, cluster)
    assert re.search(r"launcher: \S+ --with-ft ulfm .*-n 3 ", p.stdout), explain(p)
    assert not (run / "summary.json").exists(), explain(p)
    assert p.returncode != 0, explain(p)        # never a success
    if "ranks finished with status 0" not in p.stdout:
        # PRRTE's other path ("A daemon failed to report back ... exit status: 137"): mpirun's
        # own status, which train.sh passes on
        assert "ranks finished with status 137" in p.stdout and p.returncode == 137, explain(p)
        return
    assert p.returncode == 3, explain(p)
    # (PRRTE's message before it ends with a NUL byte)
    errors = [ln.strip("\0 ") for ln in p.stderr.splitlines() if ln.strip("\0 ").startswith("hpc_rlx: error")]
    assert len(errors) == 1 and "mpirun exited 0 but the run did not finish" in errors[0], explain(p)
    assert f"resubmit with hydra.run.dir={run}" in errors[0], errors
