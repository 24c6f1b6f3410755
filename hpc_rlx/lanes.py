"""Lanes: executors of the same graph on this rank's backends, run concurrently.

Each lane computes the gradient of its slice of the rank's micro-batch, scaled by its sample
count, so that summing lanes (and then ranks) gives the exact sample-weighted total. The
first host lane writes straight into the fused bucket; the others into their own buffers,
which are added into the bucket afterwards (no packing copy for the common 1-lane case).
Micro-batch slices follow each lane's measured throughput, so a slow lane never holds the
step back.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import backend, trace
from .errors import DeviceError


def resolve_lanes(kind: str, cpu_lanes: int, gpus_per_rank: int, local_rank: int) -> list[tuple[str, int]]:
    """Turn the device directive into (backend, index) lanes for this rank."""
    gpus = backend.gpu_count() if kind in ("cuda", "all", "auto") else 0
    if kind == "cpu":
        return [("cpu", i) for i in range(max(1, cpu_lanes))]
    if kind == "cuda" and gpus == 0:
        raise DeviceError("device=cuda but no GPU is usable on this rank "
                          f"({backend.gpu_unavailable_reason()})")
    gpu_lanes = []
    if gpus:
        # Ranks on a node take consecutive, disjoint GPU groups (round-robin when short).
        first = (local_rank * gpus_per_rank) % gpus
        gpu_lanes = [("cuda", (first + i) % gpus) for i in range(min(gpus_per_rank, gpus))]
    if kind == "cuda":
        return gpu_lanes + [("cpu", i) for i in range(cpu_lanes)]
    if kind == "all":
        return gpu_lanes + [("cpu", i) for i in range(max(1, cpu_lanes))]
    # auto: the fastest backend present
    return gpu_lanes if gpu_lanes else [("cpu", i) for i in range(max(1, cpu_lanes))]


def inventory() -> list[str]:
    """Every backend this rank could use."""
    return ["cpu"] + [f"cuda:{i}" for i in range(backend.gpu_count())]


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


@dataclass
class Lane:
    name: str
    kind: str                   # "cpu" | "cuda"
    xp: object
    executor: object
    param_views: dict
    grad_flat: object           # this lane's gradient storage (a view of the bucket for lane 0)
    grad_views: dict
    rate: float = 0.0           # measured samples/s (EMA)
    samples: int = 0
    busy_s: float = 0.0
    host_params: object = None  # for device lanes: the host flat params to mirror
    device_params: object = None
    extra: dict = field(default_factory=dict)

    def compute(self, x, y, seed: int) -> tuple[int, float, float, float]:
        """Sample-weighted gradient of this slice into grad_flat. Returns (n, loss_sum, correct, seconds)."""
        n = int(x.shape[0])
        t0 = time.perf_counter()
        if n == 0:
            self.grad_flat[...] = 0
            return 0, 0.0, 0.0, 0.0
        xp = self.xp
        feeds = {"x": xp.asarray(x), "y": xp.asarray(y)}
        out = self.executor.forward_backward(self.param_views, self.grad_views, feeds,
                                             train=True, seed=seed, grad_scale=float(n))
        if self.kind == "cuda":
            backend.synchronize(self.xp)
        t1 = time.perf_counter()
        dt = t1 - t0
        if trace.ACTIVE is not None:
            trace.ACTIVE.add("forward_backward", "compute", f"lane {self.name}", t0, t1, {"n": n})
        rate = n / max(dt, 1e-9)
        self.rate = rate if self.rate == 0.0 else 0.7 * self.rate + 0.3 * rate
        self.samples += n
        self.busy_s += dt
        return n, out["loss"] * n, float(out.get("correct", 0.0)), dt


class LaneSet:
    """The lanes of one rank, and their concurrent step."""

    def __init__(self, graph, lanes_spec: list[tuple[str, int]], dtype: str, params_flat: np.ndarray,
                 bucket_payload: np.ndarray, layout):
        from .graph import Executor

        self.lanes: list[Lane] = []
        self.layout = layout
        self.bucket_payload = bucket_payload
        host_owner_taken = False
        for kind, idx in lanes_spec:
            if kind == "cpu":
                xp = np
                params = params_flat
                if not host_owner_taken:
                    grad = bucket_payload
                    host_owner_taken = True
                else:
                    grad = np.zeros_like(params_flat)
                device_params = None
            else:
                xp = backend.get_xp("cuda", device=idx)
                with backend.use_device(idx):
                    device_params = xp.asarray(params_flat)
                    grad = xp.zeros_like(device_params)
                params = device_params
            ex = Executor(graph, xp=xp, dtype=dtype)
            self.lanes.append(Lane(
                name=f"{kind}{idx}", kind=kind, xp=xp, executor=ex,
                param_views=layout.views(params), grad_flat=grad, grad_views=layout.views(grad),
                host_params=params_flat, device_params=device_params))
        self._pool = ThreadPoolExecutor(max_workers=len(self.lanes)) if len(self.lanes) > 1 else None
        self._owner = next((ln for ln in self.lanes if ln.grad_flat is bucket_payload), None)

    @property
    def names(self) -> list[str]:
        return [ln.name for ln in self.lanes]

    def refresh_device_params(self) -> None:
        """After the optimizer updated the host parameters, mirror them to device lanes."""
        for ln in self.lanes:
            if ln.device_params is not None:
                ln.device_params.set(ln.host_params) if hasattr(ln.device_params, "set") else None

    def split(self, n: int) -> list[int]:
        rates = [ln.rate for ln in self.lanes]
        if any(r == 0.0 for r in rates):
            rates = [1.0] * len(rates)
        return split_by_throughput(n, rates)

    def step(self, x: np.ndarray, y: np.ndarray, seed: int) -> tuple[int, float, float, float]:
        """Run one micro-batch over all lanes; leave the summed weighted gradient in the bucket."""
        counts = self.split(int(x.shape[0]))
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        jobs = [(ln, x[bounds[i]:bounds[i + 1]], y[bounds[i]:bounds[i + 1]], seed * 64 + i)
                for i, ln in enumerate(self.lanes)]
        if self._pool is None:
            results = [jobs[0][0].compute(*jobs[0][1:])]
        else:
            results = list(self._pool.map(lambda j: j[0].compute(*j[1:]), jobs))
        self._combine()
        n = sum(r[0] for r in results)
        loss_sum = sum(r[1] for r in results)
        correct = sum(r[2] for r in results)
        wall = max(r[3] for r in results)
        return n, loss_sum, correct, wall

    def _combine(self) -> None:
        payload = self.bucket_payload
        if self._owner is None:
            payload[...] = 0
        for ln in self.lanes:
            if ln is self._owner:
                continue
            if ln.kind == "cpu":
                payload += ln.grad_flat
            else:
                payload += backend.to_numpy(ln.grad_flat)

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> tuple[float, float]:
        """(loss_sum, correct) over a host array, on the first lane."""
        ln = self.lanes[0]
        loss_sum = correct = 0.0
        for lo in range(0, int(x.shape[0]), batch):
            xb, yb = x[lo: lo + batch], y[lo: lo + batch]
            out = ln.executor.evaluate(ln.param_views, {"x": ln.xp.asarray(xb), "y": ln.xp.asarray(yb)})
            loss_sum += out["loss"] * xb.shape[0]
            correct += float(out.get("correct", 0.0))
        return loss_sum, correct

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
