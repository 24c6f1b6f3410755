"""Which lanes a rank gets, and how a step's samples are split over them (no state, no MPI).

``resolve_lanes`` turns ``device.kind``/``cpu_lanes``/``gpus_per_rank`` into (backend, index)
lanes, taking this rank's GPUs by local rank (``assign_gpus``); ``assign_samples`` splits a
micro-batch by the lanes' measured throughput (``runtime/lanes.py`` runs them).
"""

from __future__ import annotations

from hpc_rlx.base import backend
from hpc_rlx.base.errors import ConfigError, DeviceError

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
    # a batch smaller than its lanes: the active lanes keep a sample each before any probe
    probe = probe[:max(0, n - len(active))]
    counts = [0] * k
    for i, c in zip(active, split_by_throughput(n - len(probe), [rates[i] for i in active])):
        counts[i] = c
    for i in probe:
        counts[i] = 1
    return counts
