"""Lanes: executors of the same graph on this rank's backends, run concurrently.

Each lane computes the gradient of its slice of the rank's micro-batch, scaled by its sample
count, so that summing lanes (and then ranks) gives the exact sample-weighted total. Micro-batch
slices follow each lane's measured throughput, so a slow lane never holds the step back.

Where the lanes' gradients meet is the lane topology, one class each (``LaneSet(...)`` picks it):
- ``CpuLanes``, CPU lanes only: the first lane writes straight into the host bucket, the others
  into own buffers added afterwards (no packing copy in the common 1-lane case).
- ``GpuLanes``, GPU lanes only (``device=cuda``): the bucket gets a twin on the first GPU; that
  lane writes into it, the other GPUs' gradients are peer-copied there and added, so the rank's
  sum is formed on the device and one transfer (or none, with CUDA-aware MPI) feeds the collective.
- ``MixedLanes``, GPU and CPU lanes (``device=all``): the bucket stays on the host. The optimizer
  and the CPU lane are there, so the GPUs' gradients must come down anyway; they are summed on
  the first GPU and come down once, into a pinned staging buffer allocated once, then added.
  (``GpuLanesToHost``: GPU lanes only, given a plain host payload array, the same way.)
Which lanes a rank gets and how a micro-batch is split over them: ``device/lane_plan.py``.

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

from hpc_rlx.base.even_split import segments
from hpc_rlx.base import backend, cuda_mpi
from hpc_rlx.runtime.batch_sync import BatchStatSum, results_of, run_stand_in
from hpc_rlx.device.eval_counts import evaluate_counts
from hpc_rlx.device.host_blas import host_array_module
from hpc_rlx.device.lane_plan import assign_samples, split_by_throughput
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph import Executor
from hpc_rlx.graph.loss_options import loss_head
from hpc_rlx.base import trace


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
    sync: object = None         # model.sync_batch_norm: this lane's `batch_sync.LaneHook`
    scratch_grads: object = None    # where a stand-in micro-batch's gradient goes (batch_sync)
    weigh: object = None        # a weighted loss: labels -> (its mean's denominator, labelled positions)
    counted: tuple = (0.0, 0)   # ... summed over the last step's micro-batches

    def compute(self, x, y, seed: int, on_grad_ready=None, accumulate: int = 1) -> tuple[int, float, float, float]:
        """Sample-weighted gradient of this slice into grad_flat. Returns (n, loss_sum, correct, seconds).
        ``on_grad_ready(name)``: see `Executor.forward_backward` (every name, also for no samples).
        ``accumulate`` = K: the slice runs as K micro-batches summed into grad_flat (gradient
        accumulation: activations for a Kth of the rows); only the last one reports ready
        gradients, so `comm.overlap` overlaps the last micro-batch's backward.
        With ``sync`` every lane runs K micro-batches, those without rows as stand-ins (batch_sync)."""
        try:
            return self._compute(x, y, seed, on_grad_ready, accumulate)
        except BaseException:
            if self.sync is not None:
                self.sync.abort()   # the lanes waiting for this one in a batch-norm sum raise too
            raise

    def _compute(self, x, y, seed, on_grad_ready, accumulate):
        n = int(x.shape[0])
        self.counted = (0.0, 0)
        t0 = time.perf_counter()
        # The worker thread stays on this lane's GPU (no with-block: see backend.select_device).
        backend.select_device(self.device)
        k_sync = max(1, int(accumulate)) if self.sync is not None else 0
        if n == 0:
            self.grad_flat[...] = 0
            for j in range(k_sync):
                run_stand_in(self, x, y, micro_batch_seed(seed, j))
            # done before returning, like a busy lane's gradient: the main thread reads or
            # overwrites it next, maybe on another stream (per-thread default streams)
            backend.synchronize_device(self.device)
            if on_grad_ready is not None:
                for name in self.grad_views:
                    on_grad_ready(name)
            return 0, 0.0, 0.0, 0.0
        loss_sum = correct = 0.0
        parts = micro_batches(n, accumulate)
        for j, (lo, hi) in enumerate(parts):
            last = j == len(parts) - 1
            scale = float(hi - lo)    # a weighted loss: its own denominator, the statistics by rows
            if self.weigh is not None:
                w, labelled = self.weigh(y[lo:hi])
                self.counted, scale = (self.counted[0] + w, self.counted[1] + labelled), (w, scale)
            out = self.executor.forward_backward(
                self.param_views, self.grad_views, {"x": self.xp.asarray(x[lo:hi]), "y": self.xp.asarray(y[lo:hi])},
                train=True, seed=micro_batch_seed(seed, j), grad_scale=scale,
                on_grad_ready=on_grad_ready if last else None, accumulate=j > 0, sync=self.sync)
            loss_sum += out["loss"] * (scale[0] if self.weigh is not None else scale)
            correct += float(out.get("correct", 0.0))
        for j in range(len(parts), k_sync):       # micro-batches with no rows here
            run_stand_in(self, x, y, micro_batch_seed(seed, j))
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
        return n, loss_sum, correct, dt


def micro_batches(n: int, k: int) -> list[tuple[int, int]]:
    """[0, n) as at most ``k`` contiguous, non-empty row ranges, the first ones one row longer."""
    return segments(n, max(1, min(int(k), n)))


def micro_batch_seed(seed: int, j: int) -> int:
    """The dropout seed of micro-batch ``j``: the lane's own for the first (so K = 1 is the
    unaccumulated step), a distinct one for each later micro-batch."""
    return seed if j == 0 else seed + (j << 40)


class LaneSet:
    """The lanes of one rank, and their concurrent step.

    ``LaneSet(...)`` builds the class for the lanes' topology (as ``pathlib.Path()`` builds a
    ``PosixPath``), picked once by ``lane_topology``: ``CpuLanes``, ``GpuLanes``, ``MixedLanes``
    or ``GpuLanesToHost``. Each places the bucket, says which lane writes straight into it and
    sums the lanes' gradients its own way (``_place_bucket``, ``_gradient_homes``, ``_combine``);
    splitting a micro-batch, running the lanes and evaluating are the same for all, here.

    ``bucket`` is the ``comm.FusedBucket`` the gradients go to (or, for host-only callers, a
    plain payload array). ``cuda_aware`` is ``comm.cuda_aware`` (auto | true | false); with GPU
    lanes only, it decides whether the Allreduce runs on the device bucket. ``cpu_blas`` is
    ``device.cpu_blas``: the CPU lanes' matrix products on NumPy's BLAS or MKL's
    (`host_blas`), with ``cpu_threads`` threads.

    With GPU lanes, the thread that builds the LaneSet (and later calls ``step``, the bucket's
    Allreduce ...) gets the first GPU lane's device as its current device, for good.
    """

    def __new__(cls, graph, lanes_spec, dtype, params_flat, bucket, *args, **kwargs):
        if cls is LaneSet:
            cls = lane_topology(lanes_spec, bucket)
        return super().__new__(cls)

    def __init__(self, graph, lanes_spec: list[tuple[str, int]], dtype: str, params_flat: np.ndarray,
                 bucket, layout, cuda_aware="auto", query_cuda_support=None, cpu_blas="numpy",
                 cpu_threads=1, accumulate=1, sync_comm=None):
        self.layout = layout
        self.accumulate = max(1, int(accumulate))     # train.accumulate: micro-batches per lane
        # the CPU lanes' array module: NumPy, or NumPy with MKL's GEMMs (device.cpu_blas)
        self.host_xp = host_array_module(cpu_blas, cpu_threads) if any(k == "cpu" for k, _ in lanes_spec) else np
        self.host_params = params_flat
        self.bucket = None if isinstance(bucket, np.ndarray) else bucket
        self._place_bucket(cuda_aware, query_cuda_support)
        self.bucket_payload = bucket if self.bucket is None else self.bucket.payload
        homes = self._gradient_homes()     # lane kind -> the bucket array its first lane writes
        self.lanes: list[Lane] = [self._new_lane(graph, dtype, kind, idx, homes.pop(kind, None))
                                  for kind, idx in lanes_spec]
        # CPU lanes with their own gradient buffer, added into the host payload after a step
        self._cpu_peers = [ln for ln in self.lanes if ln.kind == "cpu" and ln.grad_flat is not self.bucket_payload]
        # model.sync_batch_norm: `sync_comm` (not None) sums batch-norm statistics over its ranks
        # (True: over this rank's lanes alone)
        if sync_comm is not None and any(ln.kind != "cpu" for ln in self.lanes):
            raise ConfigError("model.sync_batch_norm=true runs on CPU lanes only for now (device=cpu)")
        self.batch_sync = BatchStatSum(len(self.lanes), sync_comm) if sync_comm is not None else None
        for i, ln in enumerate(self.lanes if self.batch_sync is not None else ()):
            ln.sync = self.batch_sync.hook(i, ln.xp)
        self.head = loss_head(graph)
        for ln in self.lanes if self.head.weighted else ():
            ln.weigh = self.head.weight_of
        self._pool = ThreadPoolExecutor(max_workers=len(self.lanes)) if len(self.lanes) > 1 else None
        self._params_fresh = False      # the first step or evaluation copies the parameters up
        self.steps = 0
        self.last_counts: list[int] = []

    # ---- what each topology decides -------------------------------------------------------
    def _place_bucket(self, cuda_aware, query_cuda_support) -> None:
        """Put the bucket where the lanes' sum is formed and pick its Allreduce path."""
        raise NotImplementedError

    def _gradient_homes(self) -> dict:
        """{lane kind: bucket array}: the first lane of that kind writes its gradient there."""
        raise NotImplementedError

    def _combine(self, busy: set[int]) -> None:
        """Sum the gradients of the lanes that had samples (``id(lane)`` in ``busy``) into the bucket."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------
    def _path_choice(self, cuda_aware, on_device: bool, query_cuda_support):
        kw = {} if query_cuda_support is None else {"query": query_cuda_support}
        return cuda_mpi.choose_path(cuda_aware, on_device, wire_dtype=self.bucket.settings.wire,
                                    deterministic=self.bucket.settings.deterministic, **kw)

    def _new_lane(self, graph, dtype: str, kind: str, idx: int, grad) -> Lane:
        """A lane on backend ``kind``; ``grad`` is the bucket array it writes into, or None for
        a buffer of its own."""
        host, n_grad = self.host_params, self.layout.grad_size     # frozen parameters have no gradient
        if kind == "cpu":
            xp, device, device_params, params = self.host_xp, None, None, host
            grad = np.zeros(n_grad, host.dtype) if grad is None else grad
        else:
            xp, device = backend.get_xp("cuda", device=idx), idx
            device_params = params = backend.device_zeros(host.shape[0], host.dtype, idx)
            grad = backend.device_zeros(n_grad, host.dtype, idx) if grad is None else grad
        with backend.use_device(device):
            ex = Executor(graph, xp=xp, dtype=dtype)
            pviews, gviews = self.layout.views(params), self.layout.grad_views(grad)
        return Lane(name=f"{kind}{idx}", kind=kind, xp=xp, executor=ex, device=device,
                    param_views=pviews, grad_flat=grad, grad_views=gviews,
                    host_params=host, device_params=device_params)

    def _add_cpu_peers(self, busy: set[int]) -> None:
        for ln in self._cpu_peers:
            if id(ln) in busy:
                self.bucket_payload += ln.grad_flat

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
        self._params_fresh = True       # CPU lanes read the host parameters themselves

    def _ensure_fresh_params(self) -> None:
        if not self._params_fresh:
            self.refresh_device_params()

    def split(self, n: int) -> list[int]:
        if self.bucket is not None and self.bucket.settings.deterministic:
            # Measured rates vary run to run; a fixed split keeps each lane's partial sum, and
            # so the whole run, bitwise reproducible (comm.deterministic=true).
            return split_by_throughput(n, [1.0] * len(self.lanes))
        return assign_samples(n, [ln.rate for ln in self.lanes], self.steps)

    @property
    def overlap_capable(self) -> bool:
        """One CPU lane writing straight into the host bucket: a gradient that lane finished is
        the rank's final one, so its chunk may start reducing during backward (`comm.overlap`).
        With several lanes the peers' gradients are added after all finished: no overlap."""
        return (len(self.lanes) == 1 and self.lanes[0].kind == "cpu" and self.bucket is not None
                and self.lanes[0].grad_flat is self.bucket_payload)

    def step(self, x: np.ndarray, y: np.ndarray, seed: int, on_grad_ready=None) -> tuple[int, float, float, float]:
        """Run one micro-batch over all lanes; leave the summed weighted gradient in the bucket.
        ``on_grad_ready(name)`` hears of each final gradient when `overlap_capable` (else never)."""
        self._ensure_fresh_params()
        counts = self.split(int(x.shape[0]))
        self.last_counts = counts
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        jobs = [(ln, x[bounds[i]:bounds[i + 1]], y[bounds[i]:bounds[i + 1]], seed * 64 + i)
                for i, ln in enumerate(self.lanes)]
        k = self.accumulate
        if self.batch_sync is not None:
            self.batch_sync.start_step()
        if self._pool is None:
            ready = on_grad_ready if self.overlap_capable else None
            results = [jobs[0][0].compute(*jobs[0][1:], on_grad_ready=ready, accumulate=k)]
        else:   # (with batch_sync, a failed lane's own error rather than the barrier's)
            results = results_of([self._pool.submit(lambda j: j[0].compute(*j[1:], accumulate=k), j) for j in jobs])
        self._combine({id(ln) for ln, c in zip(self.lanes, counts) if c > 0})
        self.steps += 1
        self._params_fresh = False     # the caller is about to change the host parameters
        n = sum(r[0] for r in results)
        loss_sum = sum(r[1] for r in results)
        correct = sum(r[2] for r in results)
        wall = max(r[3] for r in results)
        self.counted = tuple(map(sum, zip(*(ln.counted for ln in self.lanes))))    # a weighted loss's
        return n, loss_sum, correct, wall

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

    def evaluate_counts(self, x: np.ndarray, y: np.ndarray, batch: int = 1024) -> dict:
        """Validation's additive counts over a host array, on the first lane (`eval_counts`)."""
        self._ensure_fresh_params()
        return evaluate_counts(self.lanes[0], self.head, x, y, batch)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class CpuLanes(LaneSet):
    """CPU lanes only: the bucket stays on the host; the first lane writes into it, the others
    into buffers of their own, added afterwards (no packing copy in the common 1-lane case)."""

    def _place_bucket(self, cuda_aware, query_cuda_support) -> None:
        if self.bucket is not None:
            self.bucket.set_choice(self._path_choice(cuda_aware, False, query_cuda_support))

    def _gradient_homes(self) -> dict:
        return {"cpu": self.bucket_payload}

    def _combine(self, busy: set[int]) -> None:
        self._add_cpu_peers(busy)


class _WithGpuLanes(LaneSet):
    """What the topologies with GPU lanes share: the calling thread works for the lead (first)
    GPU; the host parameters go up through a pinned stage; the GPUs' gradients are summed on
    the lead GPU, the peers' peer-copied through one staging buffer there."""

    def __init__(self, graph, lanes_spec, dtype, params_flat, bucket, *args, **kwargs):
        # The calling thread (the rank's main thread: refreshes, combine, the Allreduce) works
        # for the lead GPU from here on, before the first pinned allocation.
        self.lead_device = next(i for k, i in lanes_spec if k == "cuda")
        backend.select_device(self.lead_device)
        super().__init__(graph, lanes_spec, dtype, params_flat, bucket, *args, **kwargs)
        self._gpus = [ln for ln in self.lanes if ln.kind == "cuda"]
        self._lead = self._gpus[0]
        # both allocated once: the parameters' pinned stage, the peers' stage on the lead GPU
        self._params_stage = backend.pinned_empty(params_flat.shape[0], params_flat.dtype)
        self._peer_stage = (backend.device_zeros(self.layout.grad_size, params_flat.dtype, self.lead_device)
                            if len(self._gpus) > 1 else None)

    def refresh_device_params(self) -> None:
        for ln in self._gpus:        # the previous copy out of the stage must be done
            backend.synchronize_device(ln.device)
        np.copyto(self._params_stage, self.host_params)
        for ln in self._gpus:
            backend.copy_to_device(ln.device_params, self._params_stage)
        for ln in self._gpus:        # lanes run on other threads (maybe other streams): wait here
            backend.synchronize_device(ln.device)
        self._params_fresh = True

    def _sum_on_lead(self, busy: set[int]) -> bool:
        """Sum the busy GPU lanes' gradients into the lead lane's; whether it holds one now."""
        lead = self._lead
        lead_has = id(lead) in busy
        for ln in self._gpus[1:]:
            if id(ln) not in busy:
                continue
            with backend.use_device(lead.device):
                if lead_has:
                    backend.copy_between_devices(self._peer_stage, ln.grad_flat)
                    lead.grad_flat += self._peer_stage
                else:
                    backend.copy_between_devices(lead.grad_flat, ln.grad_flat)
                    lead_has = True
        return lead_has


class GpuLanes(_WithGpuLanes):
    """GPU lanes only (``device=cuda``): the bucket gets a twin on the lead GPU and the lead
    lane writes into it, so the rank's sum is formed on the device and one transfer (or none,
    with CUDA-aware MPI) feeds the collective."""

    def _place_bucket(self, cuda_aware, query_cuda_support) -> None:
        self.bucket.attach_device(self.lead_device, self._path_choice(cuda_aware, True, query_cuda_support))

    def _gradient_homes(self) -> dict:
        return {"cuda": self.bucket.memory.device_payload}

    def _combine(self, busy: set[int]) -> None:
        self._sum_on_lead(busy)
        self.bucket.memory.mark_device_fresh()       # the lead lane's gradient IS the device bucket


class MixedLanes(_WithGpuLanes):
    """GPU and CPU lanes (``device=all``): the bucket stays on the host, where the optimizer
    and the CPU lanes are, so the GPUs' gradients must come down anyway; they are summed on
    the lead GPU and come down once, into a pinned stage, to be added to the first CPU lane's
    gradient (written straight into the bucket), then the other CPU lanes' are added."""

    HOST_REASON = "CPU and GPU lanes: GPU gradients summed on the first GPU, staged once through pinned memory"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._host_stage = backend.pinned_empty(self.layout.grad_size, self.host_params.dtype)

    def _place_bucket(self, cuda_aware, query_cuda_support) -> None:
        if self.bucket is not None:
            cuda_mpi.normalize_setting(cuda_aware)     # a bad setting fails here too
            self.bucket.set_choice(cuda_mpi.PathChoice(cuda_mpi.HOST, self.HOST_REASON))

    def _gradient_homes(self) -> dict:
        return {"cpu": self.bucket_payload}

    def _combine(self, busy: set[int]) -> None:
        lead_has = self._sum_on_lead(busy)
        if lead_has:
            backend.copy_to_host(self._host_stage, self._lead.grad_flat)
        self._take_gpu_sum(lead_has)
        self._add_cpu_peers(busy)

    def _take_gpu_sum(self, lead_has: bool) -> None:
        if lead_has:
            self.bucket_payload += self._host_stage


class GpuLanesToHost(MixedLanes):
    """GPU lanes only, feeding a plain host payload array (host-only callers): combined as
    mixed lanes, but no CPU lane writes the payload, so the GPUs' sum (or zeros) replaces it."""

    def _take_gpu_sum(self, lead_has: bool) -> None:
        self.bucket_payload[...] = self._host_stage if lead_has else 0


def lane_topology(lanes_spec: list[tuple[str, int]], bucket) -> type[LaneSet]:
    """The LaneSet class for these lanes and this bucket (a FusedBucket or a plain payload)."""
    kinds = {kind for kind, _ in lanes_spec}
    if "cuda" not in kinds:
        return CpuLanes
    if "cpu" in kinds:
        return MixedLanes
    return GpuLanesToHost if isinstance(bucket, np.ndarray) else GpuLanes
