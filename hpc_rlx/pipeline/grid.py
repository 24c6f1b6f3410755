"""Where each rank sits in a pipelined job: D data-parallel replicas x S stages (pure).

World rank r is stage ``r % S`` of replica ``r // S``: a replica's stages are neighbouring
ranks (on one node when ranks are placed by node, so activations travel the fast way), and
world rank 0 is stage 0 of replica 0, the rank that draws progress and writes the run's files.

``split(world, S)`` (MPI) makes the two communicators with ``Comm.Split``:
- ``pipe``: the S stages of this rank's replica, ranked by stage (activations, their
  gradients, the step's control flags, validation sums from the last stage);
- ``data``: the D replicas of this rank's stage, ranked by replica (the stage's fused
  gradient Allreduce, its data shard: replica r reads what data-parallel rank r of D would).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.base.errors import ConfigError


@dataclass(frozen=True)
class Grid:
    world: int
    stages: int

    def __post_init__(self):
        check_world(self.world, self.stages)

    @property
    def replicas(self) -> int:
        return self.world // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def rank_of(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage


def check_world(world: int, stages: int) -> None:
    if stages < 1 or world % stages:
        raise ConfigError(f"parallel.pipeline_stages={stages} does not divide the {world} ranks "
                          f"(world size = replicas x stages); run a multiple of {stages} ranks")


@dataclass
class PipelineComms:
    grid: Grid
    rank: int        # in the world
    stage: int
    replica: int
    pipe: object     # this replica's stages (rank = stage)
    data: object     # this stage's replicas (rank = replica)

    @property
    def stages(self) -> int:
        return self.grid.stages

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.grid.stages - 1


def split(world, stages: int) -> PipelineComms:
    """Collective over ``world``: the pipeline and data-parallel communicators of this rank."""
    grid = Grid(world.size, stages)
    r = world.rank
    stage, replica = grid.stage_of(r), grid.replica_of(r)
    pipe = world.Split(color=replica, key=stage)
    data = world.Split(color=stage, key=replica)
    return PipelineComms(grid, r, stage, replica, pipe, data)
