"""Lanes on the host: GPU mapping rules, throughput splits, CPU lane sums, local ranks, the
CUDA-aware decision, and device=cuda on a machine without a GPU (runs everywhere)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlx.base import backend, cuda_mpi
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.base.errors import ConfigError, DeviceError
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params
from hpc_rlx.device.lane_plan import MIN_SHARE, PROBE_EVERY, assign_gpus, assign_samples, resolve_lanes, split_by_throughput
from hpc_rlx.runtime.lanes import LaneSet

from tests.support.jobs import REPO, explain, mpirun, train_job


# ---- GPU mapping --------------------------------------------------------------------------

def test_assign_gpus_examples():
    assert assign_gpus(4, 1, 0) == [0] and assign_gpus(4, 1, 3) == [3]
    assert assign_gpus(4, 2, 1) == [2, 3]
    assert assign_gpus(1, 1, 5) == [0]          # CUDA_VISIBLE_DEVICES per task: always GPU 0
    assert assign_gpus(2, 2, 3) == [0, 1]       # the launcher gave each rank its 2 GPUs
    assert assign_gpus(3, 1, 4) == [1]          # more ranks than GPUs: wrap around and share
    assert assign_gpus(2, 4, 0) == [0, 1]       # wants more than there are: takes what is there
    assert assign_gpus(0, 1, 0) == []


@settings(max_examples=200, deadline=None)
@given(visible=st.integers(1, 16), per=st.integers(1, 8), ranks=st.integers(1, 16))
def test_assign_gpus_is_disjoint_when_there_are_enough(visible, per, ranks):
    groups = [assign_gpus(visible, per, r) for r in range(ranks)]
    for g in groups:
        assert len(g) == min(per, visible) and len(set(g)) == len(g)
        assert all(0 <= i < visible for i in g)
    if ranks * per <= visible:
        flat = [i for g in groups for i in g]
        assert len(flat) == len(set(flat))     # nobody shares
    else:
        # every GPU is used by someone when ranks need at least all of them
        assert set().union(*map(set, groups)) == set(range(visible))


def test_resolve_lanes_without_a_gpu(monkeypatch):
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    assert resolve_lanes("cpu", 2, 1, 0) == [("cpu", 0), ("cpu", 1)]
    assert resolve_lanes("cpu", 0, 1, 0) == [("cpu", 0)]
    assert resolve_lanes("auto", 1, 1, 3) == [("cpu", 0)]
    assert resolve_lanes("all", 2, 1, 0) == [("cpu", 0), ("cpu", 1)]
    with pytest.raises(DeviceError, match="device=cuda but no GPU is usable"):
        resolve_lanes("cuda", 0, 1, 0)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=f"gpus_per_rank must be an integer >= 1, got {bad!r}"):
            resolve_lanes("cpu", 1, bad, 0)


def test_visible_devices_name_the_physical_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,GPU-1a2b")
    assert backend.visible_devices() == ["3", "5", "GPU-1a2b"]
    assert backend.physical_gpu(1) == "5" and backend.physical_gpu(2) == "GPU-1a2b"
    assert backend.physical_gpu(7) == "7"
    monkeypatch.setattr(backend, "gpu_count", lambda: 0)
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES='3,5,GPU-1a2b'"):
        resolve_lanes("cuda", 0, 1, 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert backend.visible_devices() is None and backend.physical_gpu(2) == "2"


@pytest.mark.skipif(backend.cupy_available(), reason="checks the fallbacks of a machine without CuPy")
def test_host_fallbacks_without_cupy():
    a = backend.pinned_empty(5, np.float32)
    assert isinstance(a, np.ndarray) and a.shape == (5,) and a.dtype == np.float32
    assert not backend.is_pinned(a)
    assert backend.device_of(a) is None
    backend.synchronize_device(None)
    with pytest.raises(DeviceError, match="unavailable"):
        backend.device_zeros(3, np.float32, 0)


# ---- micro-batch splits -------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), rates=st.lists(st.floats(0.01, 1e6), min_size=1, max_size=5),
       step=st.integers(0, 100))
def test_assign_samples_covers_the_batch(n, rates, step):
    counts = assign_samples(n, rates, step)
    assert sum(counts) == n and all(c >= 0 for c in counts) and len(counts) == len(rates)
    total = sum(rates)
    for c, r in zip(counts, rates):
        if c == 0 and n > 0 and n * r / total >= MIN_SHARE and len(rates) > 1:
            # only an over-subscribed tiny batch leaves a deserving lane without a sample
            assert n < len(rates)


def test_a_batch_smaller_than_the_lanes_probes_no_lane_at_the_active_ones_cost():
    # one sample, three equally fast lanes, a probe step: the active lane keeps the sample
    assert assign_samples(1, [1.0, 1.0, 1.0], step=0) == [1, 0, 0]
    assert assign_samples(2, [1000.0, 1.0, 1.0], step=PROBE_EVERY) == [1, 1, 0]


def test_slow_lane_idles_and_is_probed():
    rates = [1000.0, 1000.0, 1.0]                # a CPU lane next to two GPUs
    assert assign_samples(64, rates, step=1) == [32, 32, 0]
    probe = assign_samples(64, rates, step=PROBE_EVERY)
    assert probe[2] == 1 and sum(probe) == 64
    # a lane that deserves its share keeps it
    assert assign_samples(64, [3.0, 1.0], step=1) == [48, 16]
    # unmeasured lanes split evenly
    assert assign_samples(10, [0.0, 5.0], step=3) == [5, 5]


def test_split_by_throughput_is_proportional():
    assert split_by_throughput(100, [3.0, 1.0]) == [75, 25]
    assert split_by_throughput(2, [1.0, 1.0, 1.0]) == [1, 1, 0]
    assert sum(split_by_throughput(97, [0.3, 5.0, 2.2])) == 97


# ---- CPU lanes ----------------------------------------------------------------------------

def test_cpu_lanes_sum_to_the_one_lane_gradient():
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[12])
    layout = ParamLayout(g)
    params = np.empty(layout.size, np.float64)
    init_params(g, params, 1)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((30, 1, 8, 8)), rng.integers(0, 10, 30)
    want = np.empty_like(params)
    Executor(g, np, "float64").forward_backward(layout.views(params), layout.views(want), {"x": x, "y": y},
                                                grad_scale=30.0, seed=0)
    bucket = FusedBucket(layout.size, ("samples",), np.float64)
    lanes = LaneSet(g, [("cpu", 0), ("cpu", 1), ("cpu", 2)], "float64", params, bucket, layout)
    assert bucket.memory.device is None and bucket.choice.path == cuda_mpi.HOST
    assert lanes.lanes[0].grad_flat is bucket.payload
    for _ in range(4):                           # warm-up, then splits by measured rate
        n, loss_sum, correct, _ = lanes.step(x, y, seed=0)
        assert n == 30 and sum(lanes.last_counts) == 30
        np.testing.assert_allclose(bucket.payload, want, rtol=1e-12, atol=1e-13)
    lanes.close()


# ---- CUDA-aware decision ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 65535, 65536, 200_000 - 1])
def test_payload_finite_finds_one_bad_value_anywhere(dtype, bad, where):
    # the check runs block by block: a bad value on either side of a block edge, or in the last
    # (short) block, must still be found
    bucket = FusedBucket(200_000, ("samples",), dtype)
    bucket.payload[...] = np.linspace(-1e3, 1e3, 200_000)
    if bad is not None:
        bucket.payload[where] = bad
    assert bucket.payload_finite() is (bad is None)
    assert FusedBucket(0, ("samples",), dtype).payload_finite()


def test_cuda_aware_settings():
    assert cuda_mpi.normalize_setting(None) == "auto"
    assert cuda_mpi.normalize_setting(True) == "true" and cuda_mpi.normalize_setting(False) == "false"
    assert cuda_mpi.normalize_setting(" AUTO ") == "auto" and cuda_mpi.normalize_setting("off") == "false"
    with pytest.raises(ConfigError, match="comm.cuda_aware must be one of auto, true, false; got 'maybe'"):
        cuda_mpi.normalize_setting("maybe")


@pytest.mark.parametrize("setting,answer,kw,path", [
    ("auto", "yes", {}, cuda_mpi.DIRECT),
    ("auto", "no", {}, cuda_mpi.STAGED),
    ("auto", "unknown", {}, cuda_mpi.STAGED),
    ("true", "unknown", {}, cuda_mpi.DIRECT),
    ("false", "yes", {}, cuda_mpi.STAGED),
    ("true", "yes", {"wire_dtype": "bfloat16"}, cuda_mpi.STAGED),
    ("true", "yes", {"deterministic": True}, cuda_mpi.STAGED),
])
def test_choose_path(setting, answer, kw, path):
    choice = cuda_mpi.choose_path(setting, True, query=lambda: (answer, "test"), **kw)
    assert choice.path == path and choice.reason
    assert cuda_mpi.choose_path(setting, False, query=lambda: (answer, "test")).path == cuda_mpi.HOST


def test_query_and_doctor_line_on_this_machine():
    from mpi4py import MPI  # noqa: F401 - loads the library the query looks in

    answer, how = cuda_mpi.query_cuda_support()
    assert answer in ("yes", "no", "unknown") and how
    assert cuda_mpi.doctor_summary(0, answer, how).startswith("host")
    assert cuda_mpi.doctor_summary(2, "yes", "q").startswith("cuda-aware")
    assert cuda_mpi.doctor_summary(2, "no", "q").startswith("staged")


# ---- under mpirun -------------------------------------------------------------------------

LOCAL = r'''
import json
from mpi4py import MPI
from hpc_rlx.comm.collective import by_rank
from hpc_rlx.base.topology import node_layout
comm = MPI.COMM_WORLD
layout = node_layout(comm)
note = by_rank(comm, "same")
mixed = by_rank(comm, "a" if comm.rank < 2 else "b")
rows = comm.gather(layout, root=0)
if comm.rank == 0:
    print("RESULT " + json.dumps({"layouts": rows, "note": note, "mixed": mixed}))
'''


@pytest.mark.mpi
def test_local_rank_comes_from_the_node_not_stale_variables(tmp_path):
    script = tmp_path / "local.py"
    script.write_text(LOCAL)
    # as inside one srun task that runs mpirun: every rank inherits SLURM_LOCALID=0
    proc = mpirun(3, [str(script)], timeout=60, env={"PYTHONPATH": str(REPO), "SLURM_LOCALID": "0"})
    assert proc.returncode == 0, explain(proc)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert sorted(tuple(x) for x in res["layouts"]) == [(0, 3), (1, 3), (2, 3)]
    assert res["note"] == "same (all 3 ranks)"
    assert res["mixed"] == "a on ranks 0-1; b on ranks 2"


@pytest.mark.mpi
@pytest.mark.skipif(backend.cupy_available(), reason="this machine has a usable GPU")
def test_device_cuda_without_a_gpu_is_one_clear_error(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "device=cuda"], timeout=90)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert "DeviceError" in proc.stderr and "device=cuda but no GPU is usable" in proc.stderr, explain(proc)
    assert backend.gpu_unavailable_reason() in proc.stderr
    assert not (run / "metrics.jsonl").exists()


@pytest.mark.mpi
def test_bad_cuda_aware_setting_is_one_clear_error(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "comm.cuda_aware=sometimes"], timeout=90)
    assert proc.returncode == 2, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
    assert "comm.cuda_aware must be one of auto, true, false; got 'sometimes'" in proc.stderr, explain(proc)


@pytest.mark.mpi
def test_device_auto_and_all_fall_back_to_cpu_lanes(tmp_path, digits_h5):
    if backend.cupy_available():
        pytest.skip("this machine has a usable GPU: auto would pick it")
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={digits_h5}", "device=all", "train.epochs=1", "checkpoint=off"],
                     timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert "lanes: cpu0 (all 2 ranks)" in proc.stdout, proc.stdout
    assert "bucket on host" in proc.stdout


def test_doctor_reports_the_bucket_path():
    from hpc_rlx.doctor.check import format_report

    from tests.mpi.doctor.test_doctor import rec

    staged = format_report([rec(0, 1, gpus=2, cuda_aware="no", cuda_aware_how="q=0")], [])
    assert "GPU bucket    staged: GPU bucket copied through pinned host memory (q=0)" in staged
    direct = format_report([rec(0, 1, gpus=1, cuda_aware="yes", cuda_aware_how="q=1")], [])
    assert "GPU bucket    cuda-aware: Allreduce on the GPU bucket (q=1)" in direct
    assert "GPU bucket    host" in format_report([rec(0, 1, gpus=0)], [])
