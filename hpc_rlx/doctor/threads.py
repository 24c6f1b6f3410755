"""The doctor's thread analysis (pure: plain records in, numbers and warnings out).

Training caps each rank's BLAS at `train.threads_per_rank`, else at its share of the node's
cores (`hpc_rlx.device.threads.training_threads`); the doctor shows those numbers, not the thread
count its own process happens to start with, and warns when an explicit setting (a thread
variable or `train.threads_per_rank`) asks for more threads than a node has cores.
"""

from __future__ import annotations

from hpc_rlx.device.threads import thread_lanes, training_threads

THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def rank_train_threads(rec: dict, ranks_on_host: int, settings: dict | None) -> int:
    """The BLAS threads this rank would train with (the same rule as the training run)."""
    settings = settings or {}
    on_node = int(rec.get("ranks_on_node") or ranks_on_host)
    return training_threads(settings.get("threads_per_rank"), len(rec["cores"]) or 1, on_node,
                            thread_lanes(settings.get("cpu_lanes")))


def host_train_threads(recs: list[dict], settings: dict | None) -> list[int]:
    return [rank_train_threads(r, len(recs), settings) for r in recs]


def _env_threads(env: dict) -> list[tuple[str, int]]:
    out = []
    for key in THREAD_ENV:
        try:
            out.append((key, int(str(env[key]).split(",")[0])))   # OMP_NUM_THREADS=4,2: outer level
        except (KeyError, ValueError):
            continue
    return out


def thread_warnings(host: str, recs: list[dict], cores: int, settings: dict | None) -> list[str]:
    """Explicit thread settings that put ranks x threads above the node's cores."""
    settings = settings or {}
    n = len(recs)
    fair = max(1, cores // n)
    used = max(host_train_threads(recs, settings))
    warnings = []
    tpr = settings.get("threads_per_rank")
    if tpr is not None and n * int(tpr) > cores:
        total = n * int(tpr)
        warnings.append(
            f"{host}: train.threads_per_rank={tpr} gives {n} ranks x {tpr} threads = {total} threads "
            f"on {cores} cores (oversubscribed {total / cores:.1f}x): ranks steal cores from each "
            f"other and steps slow down. Set train.threads_per_rank={fair}, or leave it unset "
            f"(each rank then takes cores / ranks per node).")
    over = [(k, v) for k, v in _env_threads(recs[0]["env"]) if n * v > cores]
    if over:
        asked = ", ".join(f"{k}={v}" for k, v in over)
        top = max(v for _, v in over)
        total = n * top
        fix = " ".join(f"{k}={fair}" for k, _ in over)
        warnings.append(
            f"{host}: {asked} gives {n} ranks x {top} threads = {total} threads on {cores} cores "
            f"(oversubscribed {total / cores:.1f}x). Training caps the BLAS pools it finds at {used} "
            f"thread(s) per rank, but pools it does not limit (libraries loaded later, subprocesses) "
            f"follow the variable and steal cores from the other ranks. Set {fix} (slurm/train.sh "
            f"sets it to --cpus-per-task).")
    return warnings


def settings_note(settings: dict | None) -> str:
    """Where the table's training threads come from, in words."""
    settings = settings or {}
    tpr = settings.get("threads_per_rank")
    if tpr is not None:
        return f"train.threads_per_rank={tpr}"
    lanes = thread_lanes(settings.get("cpu_lanes"))
    per = "cores / ranks per node" + (f" / {lanes} CPU lanes" if lanes > 1 else "")
    return f"train.threads_per_rank unset: {per}"
