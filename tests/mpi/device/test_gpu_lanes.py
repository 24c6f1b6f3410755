"""GPU lanes and the device bucket.

Two halves:
- Simulated GPUs (`FakeGPUs`, runs everywhere): "device arrays" are NumPy arrays registered
  with a GPU id, and every transfer helper of `hpc_rlx.base.backend` is replaced by one that checks
  its direction and counts it. This exercises the lanes' and the bucket's device logic (where
  gradients are summed, which copies happen, stale parameters, both Allreduce paths, the whole
  training loop under mpirun) without CUDA. It cannot catch a wrong CuPy call.
- Real GPUs (marked `gpu`, skipped without CuPy and a device, with the reason): the same checks
  against CuPy, and training runs. bench/gpu_check.sh runs these on a GPU machine.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hpc_rlx.base import backend, cuda_mpi
from hpc_rlx.comm import collective as mpi_comm
from hpc_rlx.base.errors import DeviceError
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params
from hpc_rlx.device.lane_plan import resolve_lanes
from hpc_rlx.runtime.lanes import CpuLanes, GpuLanes, GpuLanesToHost, LaneSet, MixedLanes

from tests.support.jobs import REPO, explain, mpirun, read_metrics

HAVE_GPU = backend.cupy_available()
GPU_REASON = f"needs CuPy and a CUDA device: {backend.gpu_unavailable_reason()}"


# ==========================================================================================
# Simulated GPUs
# ==========================================================================================

class FakeGPUs:
    """`n` pretend GPUs for the device code paths (see the module docstring).

    It also models what CUDA does per thread: each thread has a current device (0 until it
    sets one); setting a device creates that device's context (CUDA 12's cudaSetDevice), and
    so does any allocation, pinned host memory included, on the current device. `contexts`
    collects the devices this process would hold a context on. `syncs` lists
    (thread id, device) for every stream synchronisation."""

    def __init__(self, n: int):
        self.n = n
        self.owner: dict[int, int] = {}
        self.keep: list[np.ndarray] = []     # keeps ids unique while the test runs
        self.counts: Counter = Counter()
        self.contexts: set[int] = set()
        self.syncs: list[tuple[int, int]] = []
        self._tls = threading.local()
        self._real_get_xp = backend.get_xp

    def device_of(self, a):
        base = a
        while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
            base = base.base
        return self.owner.get(id(base))

    # -- the current device of the calling thread --
    def current(self) -> int:
        return getattr(self._tls, "device", 0)

    def _set_current(self, device: int) -> None:
        self._tls.device = device
        self.contexts.add(device)

    @contextlib.contextmanager
    def _on(self, device):
        """cupy.cuda.Device(device) as a with-block: switch if needed, switch back on exit."""
        if device is None:
            yield
            return
        prev = self.current()
        if prev != device:
            self._set_current(device)
        try:
            yield
        finally:
            self._set_current(prev)

    # -- the replaced helpers --
    def gpu_count(self) -> int:
        return self.n

    def get_xp(self, kind, device=None):
        if isinstance(kind, str) and kind.strip().lower() in ("cuda", "gpu", "cupy"):
            if device is not None and not 0 <= device < self.n:
                raise DeviceError(f"GPU index {device!r} is out of range: this process sees {self.n} GPU(s)")
            return np
        return self._real_get_xp(kind, device)

    def use_device(self, index):
        return self._on(index)

    def select_device(self, index):
        if index is not None:
            assert 0 <= index < self.n, index
            self._set_current(index)

    def device_zeros(self, size, dtype, device):
        assert 0 <= device < self.n, device
        with self._on(device):
            a = np.zeros(int(size), dtype)
        self.owner[id(a)] = device
        self.keep.append(a)
        self.counts["alloc"] += 1
        return a

    def pinned_empty(self, size, dtype):
        self.contexts.add(self.current())     # cudaHostAlloc runs in the current device's context
        a = np.empty(int(size), dtype)
        self.keep.append(a)
        self.counts["pinned"] += 1
        return a

    def copy_to_device(self, dst, src):
        assert self.device_of(dst) is not None, "copy_to_device into host memory"
        assert self.device_of(src) is None, "copy_to_device from device memory"
        with self._on(self.device_of(dst)):
            dst[...] = src
        self.counts["h2d"] += 1

    def copy_to_host(self, dst, src, wait=True):
        assert self.device_of(src) is not None, "copy_to_host from host memory"
        assert self.device_of(dst) is None, "copy_to_host into device memory"
        with self._on(self.device_of(src)):
            dst[...] = src
        self.counts["d2h"] += 1
        self.counts["d2h_bytes"] += src.nbytes

    def copy_between_devices(self, dst, src):
        assert self.device_of(dst) is not None and self.device_of(src) is not None
        with self._on(self.device_of(dst)):
            dst[...] = src
        self.counts["d2d"] += 1

    def synchronize_device(self, index):
        if index is None:
            return
        with self._on(index):
            self.syncs.append((threading.get_ident(), index))
        self.counts["sync"] += 1

    def install(self, setter=setattr) -> "FakeGPUs":
        for name in ("gpu_count", "get_xp", "use_device", "select_device", "device_zeros", "pinned_empty",
                     "copy_to_device", "copy_to_host", "copy_between_devices", "synchronize_device"):
            setter(backend, name, getattr(self, name))
        return self


@pytest.fixture
def fake2(monkeypatch):
    return FakeGPUs(2).install(monkeypatch.setattr)


def small_model(seed=0):
    g = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[16], activation="tanh")
    layout = ParamLayout(g)
    params = np.empty(layout.size, np.float64)
    init_params(g, params, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 1, 8, 8))
    y = rng.integers(0, 10, 24)
    return g, layout, params, x, y


def reference_grad(g, layout, params, x, y):
    grad = np.empty_like(params)
    Executor(g, np, "float64").forward_backward(layout.views(params), layout.views(grad), {"x": x, "y": y},
                                                train=True, seed=0, grad_scale=float(x.shape[0]))
    return grad


def make_lanes(spec, g, layout, params, cuda_aware="auto", answer="no", payload_extra=("samples",)):
    bucket = mpi_comm.FusedBucket(layout.size, payload_extra, np.float64)
    lanes = LaneSet(g, spec, "float64", params, bucket, layout, cuda_aware=cuda_aware,
                    query_cuda_support=lambda: (answer, "test"))
    return lanes, bucket


def test_gpu_lanes_sum_on_the_lead_device_and_come_down_once(fake2):
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1)], g, layout, params)
    assert bucket.memory.device == 0
    assert fake2.device_of(lanes.lanes[0].grad_flat) == 0 and fake2.device_of(lanes.lanes[1].grad_flat) == 1
    assert fake2.device_of(bucket.memory.device_payload) == 0
    fake2.counts.clear()
    n, loss_sum, correct, _ = lanes.step(x, y, seed=0)
    assert n == 24
    # parameters went up to both GPUs, the peer's gradient was copied to the lead GPU once,
    # and nothing came down yet: the sum stays on the device until payload_to_host()
    assert fake2.counts["h2d"] == 2 and fake2.counts["d2d"] == 1 and fake2.counts["d2h"] == 0
    assert bucket.payload_finite() and fake2.counts["d2h"] == 0
    bucket.memory.payload_to_host()
    got = bucket.payload.copy()
    assert fake2.counts["d2h"] == 1
    np.testing.assert_allclose(got, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    bucket.memory.payload_to_host()              # already on the host: no second copy
    assert fake2.counts["d2h"] == 1
    assert "GPU 0" in lanes.bucket_path and "staged" in lanes.bucket_path


def test_parameters_are_never_stale(fake2):
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1)], g, layout, params)
    lanes.step(x, y, seed=0)
    params *= 0.5                         # what an optimizer step does to the host parameters
    fake2.counts.clear()
    lanes.step(x, y, seed=0)              # nobody called refresh: the step copies them itself
    assert fake2.counts["h2d"] == 2
    bucket.memory.payload_to_host()
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    params += 0.1
    lanes.refresh_device_params()         # a policy refreshes right after its update ...
    fake2.counts.clear()
    lanes.step(x, y, seed=0)              # ... so the step does not copy again
    assert fake2.counts["h2d"] == 0
    bucket.memory.payload_to_host()
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    params -= 0.2                         # evaluation also sees the newest parameters
    loss_sum, _ = lanes.evaluate(x, y)
    ref = Executor(g, np, "float64").evaluate(layout.views(params), {"x": x, "y": y})["loss"] * 24
    assert loss_sum == pytest.approx(ref, rel=1e-12)


def test_mixed_lanes_keep_the_bucket_on_the_host(fake2):
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1), ("cpu", 0)], g, layout, params)
    assert bucket.memory.device is None and bucket.choice.path == cuda_mpi.HOST
    assert lanes.lanes[2].grad_flat is bucket.payload           # the CPU lane writes in place
    fake2.counts.clear()
    lanes.step(x, y, seed=0)
    # GPUs summed on GPU 0, then one copy down into the pinned stage
    assert fake2.counts["d2d"] == 1 and fake2.counts["d2h"] == 1
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)


def test_a_plain_payload_array_takes_the_gpu_sum(fake2):
    """Host-only callers may pass a plain payload array instead of a FusedBucket."""
    g, layout, params, x, y = small_model()
    payload = np.zeros(layout.size)
    lanes = LaneSet(g, [("cuda", 0), ("cuda", 1), ("cpu", 0)], "float64", params, payload, layout)
    lanes.step(x, y, seed=0)
    assert lanes.bucket_path == "host payload"
    np.testing.assert_allclose(payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    lanes.close()


@pytest.mark.parametrize("spec, plain, cls", [
    ([("cpu", 0)], False, CpuLanes), ([("cpu", 0), ("cpu", 1)], True, CpuLanes),
    ([("cuda", 1)], False, GpuLanes), ([("cuda", 0), ("cuda", 1)], False, GpuLanes),
    ([("cuda", 0), ("cpu", 0)], False, MixedLanes), ([("cuda", 0), ("cpu", 0)], True, MixedLanes),
    ([("cuda", 0), ("cuda", 1)], True, GpuLanesToHost)])
def test_lane_set_is_the_class_of_its_topology(fake2, spec, plain, cls):
    g, layout, params, *_ = small_model()
    bucket = np.zeros(layout.size) if plain else mpi_comm.FusedBucket(layout.size, ("samples",), np.float64)
    lanes = LaneSet(g, spec, "float64", params, bucket, layout, query_cuda_support=lambda: ("no", "test"))
    assert type(lanes) is cls and isinstance(lanes, LaneSet)
    assert lanes.names == [f"{k}{i}" for k, i in spec]
    lanes.close()


def test_gpu_lanes_into_a_plain_payload_replace_it(fake2):
    """GPU lanes only, given a plain payload: no lane writes it in place, so the GPUs' sum
    replaces what was there (zeros when no lane had a sample)."""
    g, layout, params, x, y = small_model()
    payload = np.full(layout.size, 7.0)
    lanes = LaneSet(g, [("cuda", 0), ("cuda", 1)], "float64", params, payload, layout)
    lanes.step(x[:0], y[:0], seed=0)
    assert not payload.any()
    payload[...] = 7.0
    lanes.step(x, y, seed=0)
    assert lanes.last_counts == [12, 12] and lanes.bucket_path == "host payload"
    np.testing.assert_allclose(payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    lanes.close()


def test_idle_lanes_contribute_nothing(fake2):
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1), ("cpu", 0)], g, layout, params)
    for ln, r in zip(lanes.lanes, (1e6, 1e6, 1.0)):
        ln.rate = r                       # the CPU lane is far too slow to get a sample
    lanes.steps = 1                       # not a probe step
    lanes.step(x, y, seed=0)
    assert lanes.last_counts[2] == 0 and sum(lanes.last_counts) == 24
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    lanes.lanes[0].rate, lanes.lanes[1].rate = 1e6, 1e-3     # now GPU 1 idles, the lead works
    lanes.steps = 1
    lanes.step(x, y, seed=0)
    assert lanes.last_counts[1] == 0
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", [[("cuda", 1)], [("cuda", 1), ("cpu", 0)]], ids=["cuda1", "cuda1+cpu"])
def test_a_rank_on_gpu_1_never_makes_a_context_on_gpu_0(fake2, spec):
    """Ranks share a node's GPUs by local rank: the one on GPU 1 must leave GPU 0 alone (no
    context there from its main thread or its lane threads), or every rank lands on GPU 0."""
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes(spec, g, layout, params)
    for _ in range(2):
        lanes.step(x, y, seed=0)
        assert bucket.payload_finite()
        bucket.memory.payload_to_host()
        params *= 0.9
        lanes.refresh_device_params()
    lanes.evaluate(x, y)
    lanes.close()
    assert fake2.contexts == {1}


def test_an_idle_gpu_lane_finishes_its_work_before_returning(fake2):
    """An idle lane zeroes its gradient on its GPU; like a busy lane, it waits for that in its
    own thread, since the main thread reads or overwrites that gradient next."""
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1), ("cpu", 0)], g, layout, params)
    synced = {}                           # lane name -> devices it synchronised in its thread

    def watch(ln):
        compute = ln.compute

        def wrapped(*args, **kwargs):
            tid, start = threading.get_ident(), len(fake2.syncs)
            out = compute(*args, **kwargs)
            synced[ln.name] = {d for t, d in fake2.syncs[start:] if t == tid}
            return out
        ln.compute = wrapped

    for ln in lanes.lanes:
        watch(ln)
    for ln, r in zip(lanes.lanes, (1e-3, 1e6, 1e6)):
        ln.rate = r                       # the lead GPU is far too slow to get a sample
    lanes.steps = 1                       # not a probe step
    lanes.lanes[0].grad_flat[...] = 7.0   # a stale gradient the idle lane must clear
    lanes.step(x, y, seed=0)
    assert lanes.last_counts[0] == 0
    assert synced == {"cuda0": {0}, "cuda1": {1}, "cpu0": set()}
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-12, atol=1e-12)
    lanes.close()


def test_cuda_aware_choice_sets_the_direct_path(fake2):
    g, layout, params, *_ = small_model()
    for setting, answer, path in [("auto", "yes", cuda_mpi.DIRECT), ("auto", "no", cuda_mpi.STAGED),
                                  ("auto", "unknown", cuda_mpi.STAGED), ("true", "no", cuda_mpi.DIRECT),
                                  (False, "yes", cuda_mpi.STAGED)]:
        _, bucket = make_lanes([("cuda", 0)], g, layout, params, cuda_aware=setting, answer=answer)
        assert bucket.choice.path == path, (setting, answer)
    with pytest.raises(Exception, match="comm.cuda_aware.*'sometimes'"):
        make_lanes([("cuda", 0)], g, layout, params, cuda_aware="sometimes")


def test_resolve_lanes_maps_local_ranks_to_gpus(fake2):
    assert resolve_lanes("cuda", 0, 1, 0) == [("cuda", 0)]
    assert resolve_lanes("cuda", 0, 1, 1) == [("cuda", 1)]
    assert resolve_lanes("cuda", 0, 1, 2) == [("cuda", 0)]          # 3 ranks, 2 GPUs: shared
    assert resolve_lanes("cuda", 0, 2, 0) == [("cuda", 0), ("cuda", 1)]
    assert resolve_lanes("all", 1, 1, 1) == [("cuda", 1), ("cpu", 0)]
    assert resolve_lanes("auto", 1, 1, 0) == [("cuda", 0)]
    assert resolve_lanes("cuda", 1, 1, 0) == [("cuda", 0), ("cpu", 0)]


# ---- under mpirun: both Allreduce paths and the training loop on simulated GPUs ----------

WORKER = r'''
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
import numpy as np
from mpi4py import MPI
from tests.mpi.device.test_gpu_lanes import FakeGPUs, small_model
from hpc_rlx.comm import collective as mpi_comm
from hpc_rlx.runtime.lanes import LaneSet
fake = FakeGPUs(2).install()
comm = MPI.COMM_WORLD
g, layout, params, x, y = small_model()
xs, ys = x[comm.rank::comm.size], y[comm.rank::comm.size]
out = {}
for name, spec, setting in [("host", [("cpu", 0)], "auto"), ("staged", [("cuda", 0), ("cuda", 1)], "false"),
                            ("direct", [("cuda", comm.rank % 2)], "true"),
                            ("ordered", [("cuda", 0), ("cuda", 1)], "true")]:
    bucket = mpi_comm.FusedBucket(layout.size, ("samples", "loss_sum"), np.float64, cap_mb=0.001,
                                  deterministic=name == "ordered")
    lanes = LaneSet(g, spec, "float64", params, bucket, layout, cuda_aware=setting,
                    query_cuda_support=lambda: ("no", "test"))
    n, loss_sum, _, _ = lanes.step(xs, ys, seed=0)
    bucket.zero_tail(); bucket["samples"] = n; bucket["loss_sum"] = loss_sum
    before = dict(fake.counts)
    bucket.allreduce(comm)
    out[name] = {"path": bucket.last_path, "chunks": bucket.last_chunks, "samples": bucket["samples"],
                 "d2h_in_allreduce": fake.counts["d2h"] - before.get("d2h", 0),
                 "h2d_in_allreduce": fake.counts["h2d"] - before.get("h2d", 0)}
    bucket.memory.payload_to_host()
    np.save(os.path.join(os.environ["OUT"], f"{name}_{comm.rank}.npy"), bucket.payload)
if comm.rank == 0:
    print("RESULT " + json.dumps(out))
'''


@pytest.mark.mpi
def test_direct_and_staged_paths_give_the_host_result(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = mpirun(2, [str(script)], timeout=120, env={"REPO": str(REPO), "OUT": str(tmp_path)})
    assert proc.returncode == 0, explain(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["host"]["path"] == "host"
    assert res["staged"]["path"] == "staged" and res["direct"]["path"] == "cuda-aware"
    # staged: the payload came down before the collective (inside allreduce), nothing went up;
    # direct: only the tail went up and came down
    assert res["staged"]["d2h_in_allreduce"] == 1 and res["staged"]["h2d_in_allreduce"] == 0
    assert res["direct"]["h2d_in_allreduce"] == 1 and res["direct"]["d2h_in_allreduce"] == 1
    assert res["host"]["chunks"] > 1                          # the cap splits it into chunks
    assert res["ordered"]["path"] == "staged"                 # rank-order sums run on the host
    g, layout, params, x, y = small_model()
    want = reference_grad(g, layout, params, x, y)
    for name in ("host", "staged", "direct", "ordered"):
        assert res[name]["samples"] == 24
        for r in range(2):
            got = np.load(tmp_path / f"{name}_{r}.npy")
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"{name} rank {r}")


RUNNER = r'''
import os, sys
sys.path.insert(0, os.environ["REPO"])
from tests.mpi.device.test_gpu_lanes import FakeGPUs
FakeGPUs(int(os.environ["FAKE_GPUS"])).install()
from hpc_rlx.__main__ import main
main()
'''


def fake_gpu_job(tmp_path, name, n, gpus, overrides, digits_h5, timeout=180):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    run = tmp_path / name
    args = [str(script), f"hydra.run.dir={run}", "report.plots=false", f"data.path={digits_h5}"] + overrides
    proc = mpirun(n, args, timeout=timeout, env={"REPO": str(REPO), "FAKE_GPUS": str(gpus)})
    assert proc.returncode == 0, f"{name}: " + explain(proc)
    return run, proc


def final_params(run: Path) -> dict:
    import h5py
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


@pytest.mark.mpi
def test_training_on_simulated_gpus_matches_cpu_lanes(tmp_path, digits_h5):
    """The whole loop with device bucket, lazy payload, refresh and both paths: the same numbers
    as CPU lanes (the simulated GPUs compute with NumPy in the same order)."""
    base = ["train.dtype=float64", "train.epochs=2", "train.batch_size=32", "model.hidden=[32]",
            "optim.lr=0.05", "checkpoint=off", "device.cpu_lanes=2"]
    ref, _ = fake_gpu_job(tmp_path, "cpu", 2, 1, base + ["device=cpu"], digits_h5)
    want = final_params(ref)
    variants = {
        # 2 ranks share simulated GPU 0 ... with 2 GPUs per rank (device combine) ...
        "staged": (1, ["device=cuda", "device.cpu_lanes=0", "comm.cuda_aware=false"]),
        "direct": (2, ["device=cuda", "device.cpu_lanes=0", "device.gpus_per_rank=2", "comm.cuda_aware=true"]),
        "cadence": (2, ["device=cuda", "device.cpu_lanes=0", "device.gpus_per_rank=2", "policy=cadence"]),
        "all": (1, ["device=all", "device.cpu_lanes=1", "comm.wire_dtype=float16"]),
    }
    for name, (gpus, extra) in variants.items():
        run, proc = fake_gpu_job(tmp_path, name, 2, gpus, base + extra, digits_h5)
        got = final_params(run)
        if name in ("staged", "direct"):
            for k in want:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-12, err_msg=f"{name}: {k}")
        elif name == "all":         # a float16 wire: close, not equal (rounding compounds over ~90 steps)
            for k in want:
                assert np.abs(got[k] - want[k]).max() <= 5e-2 * np.abs(want[k]).max(), (name, k)
        if name == "all":
            assert "bucket on host" in proc.stdout and "wire float16" in proc.stdout, proc.stdout
        else:
            assert "bucket on GPU 0" in proc.stdout, proc.stdout
        summary = json.loads((run / "summary.json").read_text())
        assert all(r["lanes"][0].startswith("cuda") for r in summary["ranks"])
    metrics = read_metrics(tmp_path / "cadence")
    assert metrics[-1]["val_accuracy"] > 0.5


# ==========================================================================================
# Real GPUs
# ==========================================================================================

@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason=GPU_REASON)
def test_real_transfers_round_trip():
    cp = backend.get_xp("cuda")
    host = backend.pinned_empty(1000, np.float32)
    assert backend.is_pinned(host) and backend.is_pinned(host[10:20])
    host[...] = np.arange(1000, dtype=np.float32)
    dev = backend.device_zeros(1000, np.float32, 0)
    backend.copy_to_device(dev, host)
    backend.synchronize_device(0)
    assert float(cp.sum(dev)) == float(np.sum(host))
    back = backend.pinned_empty(1000, np.float32)
    backend.copy_to_host(back, dev * 2)
    np.testing.assert_array_equal(back, host * 2)
    with pytest.raises(ValueError):
        backend.copy_to_host(np.empty(999, np.float32), dev)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason=GPU_REASON)
@pytest.mark.parametrize("spec", [[("cuda", 0)], [("cuda", 0), ("cpu", 0)], [("cuda", 0), ("cuda", 0)]],
                         ids=["cuda", "cuda+cpu", "two-lanes-one-gpu"])
def test_real_gpu_lanes_match_numpy(spec):
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes(spec, g, layout, params)
    for _ in range(3):                    # warm-up, then rated splits
        lanes.step(x, y, seed=0)
    assert bucket.payload_finite()
    bucket.memory.payload_to_host()
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-9, atol=1e-10)
    params *= 0.9
    lanes.step(x, y, seed=0)
    bucket.memory.payload_to_host()
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-9, atol=1e-10)
    lanes.close()


@pytest.mark.gpu
@pytest.mark.skipif(backend.gpu_count() < 2, reason="needs 2 GPUs: " + (backend.gpu_unavailable_reason() or
                                                                        f"{backend.gpu_count()} visible"))
def test_real_two_gpus_combine_on_the_lead():
    g, layout, params, x, y = small_model()
    lanes, bucket = make_lanes([("cuda", 0), ("cuda", 1)], g, layout, params)
    lanes.step(x, y, seed=0)
    assert backend.device_of(bucket.memory.device_payload) == 0
    bucket.memory.payload_to_host()
    np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-9, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(backend.gpu_count() < 2, reason="needs 2 GPUs: " + (backend.gpu_unavailable_reason() or
                                                                        f"{backend.gpu_count()} visible"))
def test_real_rank_on_gpu_1_keeps_gpu_1_current():
    cp = backend.get_xp("cuda")
    g, layout, params, x, y = small_model()
    try:
        lanes, bucket = make_lanes([("cuda", 1), ("cpu", 0)], g, layout, params)
        assert cp.cuda.runtime.getDevice() == 1      # the main thread works for the rank's GPU
        lanes.step(x, y, seed=0)
        assert cp.cuda.runtime.getDevice() == 1
        bucket.memory.payload_to_host()
        np.testing.assert_allclose(bucket.payload, reference_grad(g, layout, params, x, y), rtol=1e-9, atol=1e-10)
        lanes.close()
    finally:
        backend.select_device(0)                     # later tests in this process expect GPU 0


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not HAVE_GPU, reason=GPU_REASON)
@pytest.mark.parametrize("n,overrides", [
    (1, ["device=cuda"]),
    (1, ["device=all"]),
    (2, ["device=cuda", "comm.cuda_aware=false"]),
    (2, ["device=cuda", "comm.cuda_aware=auto"]),
], ids=["cuda", "all", "2ranks-staged", "2ranks-auto"])
def test_real_gpu_training_reaches_accuracy(tmp_path, digits_h5, n, overrides):
    from tests.support.jobs import train_job
    run = tmp_path / "run"
    proc = train_job(n, run, [f"data.path={digits_h5}", "train.epochs=10", "checkpoint=off"] + overrides,
                     timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert read_metrics(run)[-1]["val_accuracy"] >= 0.9
    assert "bucket on" in proc.stdout


def integer_input_jobs(tmp_path, devices):
    """`device=D` jobs (1 rank, float64) on an int16 file (CosmoFlow's counts): the feed holds
    the inputs as stored and casts each batch, which a GPU lane then copies up. Returns the
    metrics of each job, in the order of ``devices``."""
    import h5py

    from tests.support.jobs import train_job
    rng = np.random.default_rng(3)
    path = tmp_path / "counts.h5"
    with h5py.File(path, "w") as f:
        f["x"] = rng.integers(-20, 40, (640, 12)).astype(np.int16)
        f["y"] = rng.integers(0, 3, 640).astype(np.int64)
        f.attrs["num_classes"] = 3
    base = ["data=file", f"data.path={path}", "model=mlp", "model.hidden=[16]", "train.dtype=float64",
            "train.epochs=2", "train.batch_size=32", "optim.lr=0.001", "checkpoint=off"]
    out = []
    for i, device in enumerate(devices):
        proc = train_job(1, tmp_path / f"{device}-{i}", base + [f"device={device}"], timeout=120)
        assert proc.returncode == 0, explain(proc)
        out.append(read_metrics(tmp_path / f"{device}-{i}"))
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason=GPU_REASON)
def test_real_gpu_lane_trains_integer_inputs_as_the_cpu_lane(tmp_path):
    cpu, cuda = integer_input_jobs(tmp_path, ["cpu", "cuda"])
    assert len(cpu) == len(cuda) == 2
    for a, b in zip(cpu, cuda):
        for key in ("train_loss", "val_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), (key, a[key], b[key])
