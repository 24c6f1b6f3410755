"""What a run's epochs run on: one rank's communicator and the parts set up over it. Set-up
makes it once; a recovery after a dead rank (`resilience.in_run`) returns the survivors' one
in its place. Nothing assigns to it: a change is a new context. `set_up_lanes`: the part of
set-up that makes its lanes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_rlx.comm import collective
from hpc_rlx.base.topology import local_rank
from hpc_rlx.device.host_blas import blas_note
from hpc_rlx.device.lane_plan import describe_lanes, resolve_lanes
from hpc_rlx.runtime.lanes import LaneSet
from hpc_rlx.runtime import pipelined


@dataclass(frozen=True)
class RunContext:
    """`comm`: the ranks that run (the survivors', after a dead rank); `rank`: this one's number
    in it; `is_root`: whether it writes the run directory; `worker`, `lanes` and `policy`: what
    trains; `checkpoints`; `outputs` (the run directory's files, on the root only) and
    `display` (progress and per-step records)."""
    comm: Any
    rank: int
    is_root: bool
    worker: Any
    lanes: Any
    policy: Any
    checkpoints: Any
    outputs: Any
    display: Any


def set_up_lanes(spec, comm, place, worker, threads: int | None, log):
    """Collective: the rank's lanes, which place the bucket (device twin or host) and pick its
    Allreduce path; their start-up lines logged. `place`: the rank's `pipelined.RankPlace`."""
    lanes_spec = collective.agree(comm, lambda: resolve_lanes(
        spec.device["kind"], int(spec.device["cpu_lanes"]), int(spec.device["gpus_per_rank"]),
        local_rank(comm)))
    if spec.comm["shared_memory"] and not place.comms:   # before the lanes take views of it
        worker.bucket.share_node_memory(comm, cpu_only=all(kind == "cpu" for kind, _ in lanes_spec))
    lanes = pipelined.lane_set(place, worker, threads) if place.comms \
        else collective.agree(comm, lambda: LaneSet(
        worker.graph, lanes_spec, spec.train["dtype"], worker.params, worker.bucket, worker.layout,
        cuda_aware=spec.comm["cuda_aware"], cpu_blas=spec.device["cpu_blas"], cpu_threads=threads,
        accumulate=int(spec.train.get("accumulate") or 1), sync_comm=worker.batch_norm_comm))
    lane_note = collective.by_rank(comm, describe_lanes(lanes_spec) + blas_note(spec.device["cpu_blas"],
                                                                              threads, lanes_spec))
    bucket_note = collective.by_rank(comm, lanes.bucket_path)
    log(f"lanes: {lane_note}")
    log(f"{bucket_note}")
    return lanes
