"""Lanes: executors of the same graph on this rank's backends, run concurrently.

Each lane computes the gradient of its slice of the rank's micro-batch, scaled by its sample
count, so that summing lanes (and then ranks) gives the exact sample-weighted total. Micro-batch
slices follow each lane's measured throughput, so a slow lane never holds the step back.

Where the lanes' gradients meet:
- CPU lanes only: the first lane writes straight into the host bucket, the others into own
  buffers added afterwards (no packing copy in the common 1-lane case).
- GPU lanes only (``device=cuda``): the bucket gets a twin on the first GPU; that lane writes
  into it, the other GPUs' gradients are peer-copied there and added, so the rank's sum is
  formed on the device and one transfer (or none, with CUDA-aware MPI) feeds the collective.
- GPU and CPU lanes (``device=all``): the bucket stays on the host. The optimizer and the CPU
  lane are there, so the GPUs' gradients must come down anyway; they are summed on the first
  GPU and come down once, into a pinned staging buffer allocated once, then added.

Parameters live on the host (the optimizer, checkpoints and policies work there). GPU lanes
keep a device copy that is refreshed before a step or an evaluation whenever the host
parameters may have changed: ``refresh_device_params()`` copies them now (policies call it
right after they update the parameters), and ``step``/``evaluate`` copy them themselves
unless a refresh happened since the previous step, so no lane ever trains on stale weights.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from hpc_rlx.device import backend, cuda_mpi
from hpc_rlx.errors import ConfigError, DeviceError
from hpc_rlx.graph import Executor
from hpc_rlx.observe import trace

# A lane whose share of a step would be under half a sample idles (it would only stall the
# others); it gets one sample every PROBE_EVERY steps so its speed keeps being measured.
PROBE_EVERY = 25
MIN_SHARE = 0.5


def assign_gpus(visible: int, gpus_per_rank: int, local_rank: int) -> list[int]:
    """The GPU indices (as this process numbers them) for one rank.

    Ranks on a node take consecutive, disjoint groups of ``gpus_per_rank``; when the launcher
    already gave each rank its own GPUs (CUDA_VISIBLE_DEVICES per task, so ``visible`` is
    ``gpus_per_rank`` or fewer) every rank starts at 0. With fewer GPUs than ranks need, the
    groups wrap around and ranks share GPUs.
    """
    if visible <= 0:
        return []
    want = min(int(gpus_per_rank), visible)
    first = (int(local_rank) * int(gpus_per_rank)) % visible
    return [(first + i) % visible for i in range(want)]


def resolve_lanes(kind: str, cpu_lanes: int, gpus_per_rank: int, local_rank: int) -> list[tuple[str, int]]:
    """Turn the device directive into (backend, index) lanes for this rank."""
    if not isinstance(gpus_per_rank, int) or isinstance(gpus_per_rank, bool) or gpus_per_rank < 1:
        raise ConfigError(f"device.gpus_per_rank must be an integer >= 1, got {gpus_per_rank!r}")
    if kind == "cpu":
        return [("cpu", i) for i in range(max(1, cpu_lanes))]
    gpus = backend.gpu_count() if kind in ("cuda", "all", "auto") else 0
    if kind == "cuda" and gpus == 0:
        vis = backend.visible_devices()
        note = "" if vis is None else f"; CUDA_VISIBLE_DEVICES={','.join(vis)!r}"
        raise DeviceError("device=cuda but no GPU is usable on this rank "
                          f"({backend.gpu_unavailable_reason()}{note}); use device=cpu, or device=auto "
                          "to take GPUs where there are some")
    gpu_lanes = [("cuda", i) for i in assign_gpus(gpus, gpus_per_rank, local_rank)]
    if kind == "cuda":
        return gpu_lanes + [("cpu", i) for i in range(cpu_lanes)]
    if kind == "all":
        return gpu_lanes + [("cpu", i) for i in range(max(1, cpu_lanes))]
    # auto: the fastest backend present
    return gpu_lanes if gpu_lanes else [("cpu", i) for i in range(max(1, cpu_lanes))]


def inventory() -> list[str]:
    """Every backend this rank could use."""
    return ["cpu"] + [f"cuda:{i}" for i in range(backend.gpu_count())]


def describe_lanes(lanes_spec: list[tuple[str, int]]) -> str:
    """Lane names with the node-level GPU behind each (CUDA_VISIBLE_DEVICES applied)."""
    out = []
    for kind, idx in lanes_spec:
        if kind == "cuda" and backend.visible_devices() is not None:
            out.append(f"cuda{idx} (GPU {backend.physical_gpu(idx)})")
        else:
            out.append(f"{kind}{idx}")
    return ", ".join(out)


def split_by_throughput(n: int, rates: list[float]) -> list[int]:
    """Split n samples proportionally to rates (largest remainder); every lane gets at least
    one sample while n allows, so every lane's rate keeps being measured."""
    k = len(rates)
    if k == 1:
        return [n]
    if n <= k:
        return [1 if i < n else 0 for i in range(k)]
    base = [1] * k
    rest = n - k
    total = sum(rates)
    shares = [rest * r / total for r in rates]
    counts = [int(s) for s in shares]
    order = sorted(range(k), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in order[: rest - sum(counts)]:
        counts[i] += 1
    return [b + c for b, c in zip(base, counts)]


def assign_samples(n: int, rates: list[float], step: int) -> list[int]:
    """Samples per lane for one step: proportional to measured rates, but a lane too slow to
    deserve even half a sample sits the step out (it would make the fast lanes wait), except
    on every PROBE_EVERY-th step, when it gets one sample to measure it again. Unmeasured
    lanes (rate 0) share equally until every lane has a rate."""
    k = len(rates)
    if k == 1 or n == 0:
        return [n] + [0] * (k - 1)
    if any(r <= 0.0 for r in rates):
        return split_by_throughput(n, [1.0] * k)
    total = sum(rates)
    active = [i for i in range(k) if n * rates[i] / total >= MIN_SHARE]
    if not active:
        active = [max(range(k), key=lambda i: rates[i])]
    probe = [i for i in range(k) if i not in active] if step % PROBE_EVERY == 0 else []
    counts = [0] * k
    for i, c in zip(active, split_by_throughput(n - len(probe), [rates[i] for i in active])):
        counts[i] = c
    for i in probe:
        counts[i] = 1
    return counts


@dataclass
class Lane:
    name: str
    kind: str                   # "cpu" | "cuda"
    xp: object
    executor: object
    param_views: dict
    grad_flat: object           # this lane's gradient storage (a view of the bucket for the owner)
    grad_views: dict
    device: int | None = None   # the GPU of a cuda lane
    rate: float = 0.0           # measured samples/s (EMA), 0 until measured after warm-up
    samples: int = 0
    busy_s: float = 0.0
    calls: int = 0              # steps with samples (the first, with one-off costs, is not rated)
    host_params: object = None  # for device lanes: the host flat params to mirror
    device_params: object = None

    def compute(self, x, y, seed: int) -> tuple[int, float, float, float]:
        """Sample-weighted gradient of this slice into grad_flat. Returns (n, loss_sum, correct, seconds)."""
        n = int(x.shape[0])
        t0 = time.perf_counter()
        # The worker thread stays on this lane's GPU (no with-block: see backend.select_device).
        backend.select_device(self.device)
        if n == 0:
            self.grad_flat[...] = 0
            # done before returning, like a busy lane's gradient: the main thread reads or
            # overwrites it next, maybe on another stream (per-thread default streams)
            backend.synchronize_device(self.device)
            return 0, 0.0, 0.0, 0.0
        xp = self.xp
        feeds = {"x": xp.asarray(x), "y": xp.asarray(y)}
        out = self.executor.forward_backward(self.param_views, self.grad_views, feeds,
                                             train=True, seed=seed, grad_scale=float(n))
        backend.synchronize_device(self.device)
        t1 = time.perf_counter()
        dt = t1 - t0
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("forward_backward", "compute", f"lane {self.name}", t0, t1, {"n": n})
        self.calls += 1
        if self.calls > 1:       # the first call pays allocation / kernel compilation: not a rate
            rate = n / max(dt, 1e-9)
            self.rate = rate if self.rate == 0.0 else 0.7 * self.rate + 0.3 * rate
        self.samples += n
        self.busy_s += dt
        return n, out["loss"] * n, float(out.get("correct", 0.0)), dt


class LaneSet:
    """The lanes of one rank, and their concurrent step.

    ``bucket`` is the ``comm.FusedBucket`` the gradients go to (or, for host-only callers, a
    plain payload array). ``cuda_aware`` is ``comm.cuda_aware`` (auto | true | false); with GPU
    lanes only, it decides whether the Allreduce runs on the device bucket.

    With GPU lanes, the thread that builds the LaneSet (and later calls ``step``, the bucket's
    Allreduce ...) gets the first GPU lane's device as its current device, for good.
    """

    def __init__(self, graph, lanes_spec: list[tuple[str, int]], dtype: str, params_flat: np.ndarray,
                 bucket, layout, cuda_aware="auto", query_cuda_support=None):

        self.lanes: list[Lane] = []
        self.layout = layout
        self.host_params = params_flat
        self.bucket = None if isinstance(bucket, np.ndarray) else bucket
        kinds = [k for k, _ in lanes_spec]
        gpu_idx = [i for k, i in lanes_spec if k == "cuda"]
        # The calling thread (the rank's main thread: refreshes, combine, the Allreduce) works
        # for the lead GPU from here on, before the first pinned allocation below.
        backend.select_device(gpu_idx[0] if gpu_idx else None)
        self.device_bucket = bool(gpu_idx) and all(k == "cuda" for k in kinds) and self.bucket is not None
        if self.bucket is not None:
            kw = {} if query_cuda_support is None else {"query": query_cuda_support}
            choice = cuda_mpi.choose_path(cuda_aware, self.device_bucket, wire_dtype=self.bucket.wire,
                                          deterministic=self.bucket.deterministic, **kw)
            if self.device_bucket:
                self.bucket.attach_device(gpu_idx[0], choice)
            else:
                if gpu_idx:
                    choice = cuda_mpi.PathChoice(cuda_mpi.HOST, "CPU and GPU lanes: GPU gradients summed "
                                                 "on the first GPU, staged once through pinned memory")
                self.bucket.set_choice(choice)
        host_payload = self.bucket.payload if self.bucket is not None else bucket
        self.bucket_payload = host_payload

        self._params_stage = backend.pinned_empty(params_flat.shape[0], params_flat.dtype) if gpu_idx else None
        host_owner_taken = self.device_bucket
        for kind, idx in lanes_spec:
            if kind == "cpu":
                xp, device, device_params, params = np, None, None, params_flat
                if not host_owner_taken:
                    grad = host_payload
                    host_owner_taken = True
                else:
                    grad = np.zeros_like(params_flat)
            else:
                xp = backend.get_xp("cuda", device=idx)
                device = idx
                device_params = backend.device_zeros(params_flat.shape[0], params_flat.dtype, idx)
                params = device_params
                if self.device_bucket and not any(ln.kind == "cuda" for ln in self.lanes):
                    grad = self.bucket.device_payload
                else:
                    grad = backend.device_zeros(params_flat.shape[0], params_flat.dtype, idx)
            with backend.use_device(device):
                ex = Executor(graph, xp=xp, dtype=dtype)
                pviews, gviews = layout.views(params), layout.views(grad)
            self.lanes.append(Lane(
                name=f"{kind}{idx}", kind=kind, xp=xp, executor=ex, device=device,
                param_views=pviews, grad_flat=grad, grad_views=gviews,
                host_params=params_flat, device_params=device_params))
        self._gpu = [ln for ln in self.lanes if ln.kind == "cuda"]
        self._owner = next((ln for ln in self.lanes if ln.kind == "cpu" and ln.grad_flat is host_payload), None)
        lead = self._gpu[0] if self._gpu else None
        # One staging buffer on the lead GPU for the peers' gradients, and (mixed lanes) one
        # pinned host buffer for the GPUs' sum: both allocated once.
        self._peer_stage = (backend.device_zeros(params_flat.shape[0], params_flat.dtype, lead.device)
                            if len(self._gpu) > 1 else None)
        self._host_stage = (backend.pinned_empty(params_flat.shape[0], params_flat.dtype)
                            if self._gpu and not self.device_bucket else None)
        self._pool = ThreadPoolExecutor(max_workers=len(self.lanes)) if len(self.lanes) > 1 else None
        self._params_fresh = False      # the first step or evaluation copies the parameters up
        self.steps = 0
        self.last_counts: list[int] = []

    @property
    def names(self) -> list[str]:
        return [ln.name for ln in self.lanes]

    @property
    def bucket_path(self) -> str:
        """One line for the log: where the bucket lives and how it is reduced."""
        if self.bucket is None:
            return "host payload"
        return self.bucket.describe()

    def refresh_device_params(self) -> None:
        """Mirror the host parameters to every GPU lane now (after the optimizer changed them)."""
        if self._gpu:
            for ln in self._gpu:     # the previous copy out of the stage must be done
                backend.synchronize_device(ln.device)
            np.copyto(self._params_stage, self.host_params)
            for ln in self._gpu:
                backend.copy_to_device(ln.device_params, self._params_stage)
            for ln in self._gpu:     # lanes run on other threads (maybe other streams): wait here
                backend.synchronize_device(ln.device)
        self._params_fresh = True

    def _ensure_fresh_params(self) -> None:
        if not self._params_fresh:
            self.refresh_device_params()

    def split(self, n: int) -> list[int]:
        if self.bucket is not None and self.bucket.deterministic:
            # Measured rates vary run to run; a fixed split keeps each lane's partial sum, and
            # so the whole run, bitwise reproducible (comm.deterministic=true).
            return split_by_throughput(n, [1.0] * len(self.lanes))
        return assign_samples(n, [ln.rate for ln in self.lanes], self.steps)

    def step(self, x: np.ndarray, y: np.ndarray, seed: int) -> tuple[int, float, float, float]:
        """Run one micro-batch over all lanes; leave the summed weighted gradient in the bucket."""
        self._ensure_fresh_params()
        counts = self.split(int(x.shape[0]))
        self.last_counts = counts
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        jobs = [(ln, x[bounds[i]:bounds[i + 1]], y[bounds[i]:bounds[i + 1]], seed * 64 + i)
                for i, ln in enumerate(self.lanes)]
        if self._pool is None:
            results = [jobs[0][0].compute(*jobs[0][1:])]
        else:
            results = list(self._pool.map(lambda j: j[0].compute(*j[1:]), jobs))
        self._combine(counts)
        self.steps += 1
        self._params_fresh = False     # the caller is about to change the host parameters
        n = sum(r[0] for r in results)
        loss_sum = sum(r[1] for r in results)
        correct = sum(r[2] for r in results)
        wall = max(r[3] for r in results)
        return n, loss_sum, correct, wall

    def _combine(self, counts: list[int]) -> None:
        busy = {id(ln) for ln, c in zip(self.lanes, counts) if c > 0}
        lead_has = False                # whether the lead GPU holds a gradient to pass on
        if self._gpu:
            lead = self._gpu[0]
            lead_has = id(lead) in busy
            for ln in self._gpu[1:]:
                if id(ln) not in busy:
                    continue
                with backend.use_device(lead.device):
                    if lead_has:
                        backend.copy_between_devices(self._peer_stage, ln.grad_flat)
                        lead.grad_flat += self._peer_stage
                    else:
                        backend.copy_between_devices(lead.grad_flat, ln.grad_flat)
                        lead_has = True
            if self.device_bucket:
                self.bucket.mark_device_fresh()   # the lead lane's gradient IS the device bucket
            elif lead_has:
                backend.copy_to_host(self._host_stage, lead.grad_flat)
        payload = self.bucket_payload
        if self._owner is None and not self.device_bucket:
            if self._gpu and lead_has:
                payload[...] = self._host_stage
            else:
                payload[...] = 0
        elif self._owner is not None and self._gpu and lead_has:
            payload += self._host_stage
        for ln in self.lanes:
            if ln.kind == "cpu" and ln is not self._owner and id(ln) in busy:
                payload += ln.grad_flat

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> tuple[float, float]:
        """(loss_sum, correct) over a host array, on the first lane."""
        self._ensure_fresh_params()
        ln = self.lanes[0]
        loss_sum = correct = 0.0
        with backend.use_device(ln.device):
            for lo in range(0, int(x.shape[0]), batch):
                xb, yb = x[lo: lo + batch], y[lo: lo + batch]
                out = ln.executor.evaluate(ln.param_views, {"x": ln.xp.asarray(xb), "y": ln.xp.asarray(yb)})
                loss_sum += out["loss"] * xb.shape[0]
                correct += float(out.get("correct", 0.0))
        return loss_sum, correct

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
