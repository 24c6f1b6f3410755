"""A rank of a pipelined job (``parallel.pipeline_stages`` S > 1): what ``Run`` builds instead.

The loop, the policy (``sync``) and the ``Worker`` stay as they are; a pipelined rank differs
only in what they are given:

- ``for_rank``: the ``Worker`` gets this rank's stage as its graph (so it allocates, initialises
  and optimises only that stage's parameters, gradients and optimizer state) and the stage's
  data-parallel communicator as its ``comm`` (so its data shard is replica r's of D, its bucket
  is the stage's, its Initial-weights Bcast and validation Allreduce run among the stage's
  replicas);
- ``lane_set``: ``pipeline.adapters.PipelineLaneSet`` stands for the rank's ``LaneSet`` (the
  stage's lanes), and the worker's bucket is wrapped in ``PipelineBucket`` (its Allreduce over
  the stage's replicas, then the tail agreed along the pipeline; see ``pipeline/adapters.py``).

With S = 1 ``for_rank`` returns the spec and communicator unchanged and nothing here runs.

Checkpoints (``checkpoint/stages.py``, set up by ``RuntimeCheckpoints(pipeline=place.comms)``)
are the data-parallel file: the whole model's flat ``params`` and ``opt/*`` arrays in the whole
graph's ``ParamLayout`` order. Rank 0 writes them one stage at a time, as ``final_params`` does
for model.h5 (a stage's parameters are named, so the whole layout's offsets place them):
replica 0 of each later stage sends its parameters and optimizer state, which rank 0 writes
into the file's datasets as they arrive. Resume reads each stage's share from the verified file
on rank 0 and sends it to every replica of that stage, so a checkpoint moves between S = 1 and
any S and D.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hpc_rlx.device.host_blas import host_array_module
from hpc_rlx.graph import Graph, ParamLayout
from hpc_rlx.graph.partition import partition
from hpc_rlx.pipeline.engine import StageEngine
from hpc_rlx.pipeline.grid import PipelineComms, split
from hpc_rlx.pipeline.adapters import PipelineBucket, PipelineLaneSet


@dataclass
class RankPlace:
    spec: object                        # the spec the Worker gets (its stage's graph)
    comm: object                        # the communicator the Worker gets
    comms: PipelineComms | None = None  # None: not pipelined


def for_rank(spec, world) -> RankPlace:
    """Collective over ``world`` when S > 1 (``Comm.Split``)."""
    stages = int(spec.parallel.get("pipeline_stages", 1))
    if stages == 1:
        return RankPlace(spec, world)
    comms = split(world, stages)
    parts = partition(Graph.from_dict(spec.graph), stages, cut_points=spec.parallel.get("cut_points"))
    return RankPlace(replace(spec, graph=parts[comms.stage].to_dict()), comms.data, comms)


def lane_set(place: RankPlace, worker, cpu_threads: int = 1) -> PipelineLaneSet:
    """The lane set of a pipelined ``worker``; wraps its bucket (see the module docstring)."""
    spec, plan = place.spec, worker.plan
    max_rows = max(plan.rank_batch(r) for r in range(plan.world_size))
    engine = StageEngine(worker.graph, place.comms, spec.parallel["schedule"], int(spec.parallel["microbatches"]),
                         max_rows, spec.train["dtype"], lanes=int(spec.device["cpu_lanes"]),
                         xp=host_array_module(spec.device["cpu_blas"], cpu_threads))
    worker.bucket = PipelineBucket(worker.bucket, place.comms)
    worker.stage_pipe = place.comms.pipe        # clipping takes the whole model's norm
    return PipelineLaneSet(engine, worker.params, worker.layout, worker.bucket)


# ---- the trained model: model.h5 on rank 0, one stage at a time ------------------------------
_PARAMS_TAG = 77


def final_params(place: RankPlace, worker, whole_graph: dict):
    """Rank 0: (name, array) of every parameter of the whole model, stage by stage: its own
    stage's, then each later stage's received from that stage's first replica (so rank 0 holds
    one stage's parameters besides its own at a time). Consume it to the end (a caller that
    stops early drains it), or the senders wait."""
    if place.comms is None:
        yield from worker.layout.views(worker.params).items()
        return
    yield from worker.layout.views(worker.params).items()
    parts = partition(Graph.from_dict(whole_graph), place.comms.stages,
                      cut_points=place.spec.parallel.get("cut_points"))
    for k in range(1, place.comms.stages):
        layout = ParamLayout(parts[k])
        buf = np.empty(layout.size, dtype=worker.params.dtype)
        place.comms.pipe.Recv(buf, source=k, tag=_PARAMS_TAG)
        yield from layout.views(buf).items()


def send_final_params(place: RankPlace, worker) -> None:
    """The first replica's stages after the first: hand this stage's parameters to rank 0."""
    if place.comms is not None and place.comms.replica == 0 and place.comms.stage > 0:
        place.comms.pipe.Send(worker.params, dest=0, tag=_PARAMS_TAG)
