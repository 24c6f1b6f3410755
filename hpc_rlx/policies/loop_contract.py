"""What a policy may use of the training run, typed: `Loop` (the run's step services), and
through it `LoopWorker` (one rank's data, parameters, bucket and position), `StepLanes` and
`StepHooks`. Each names exactly the members some policy uses (the architecture test holds
them to that), so a policy cannot quietly depend on more of the run than is written here.

The run (`runtime.train.Run`, a layer above) and its worker satisfy these by their shape;
nothing here imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np

from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.data.plan import ShardPlan
from hpc_rlx.graph.ir import Graph
from hpc_rlx.injection.slowdown import SlowdownInjector
from hpc_rlx.optim.base import Optimizer

if TYPE_CHECKING:
    from mpi4py import MPI


class RunSpec(Protocol):
    """The parts of the run's `TrainSpec` a policy reads."""

    train: Mapping[str, Any]     # train.* (the seed of the local steps' dropout masks)
    graph: Graph                 # the model (a weighted loss?)


class StepCounter(Protocol):
    """The training position's writer (`runtime.state.TrainState`), as far as a step moves it."""

    def step_taken(self, step_in_epoch: int | None = None) -> None: ...


class LoopWorker(Protocol):
    """One rank's state as a policy's step uses it (`runtime.worker.Worker`)."""

    spec: RunSpec
    comm: MPI.Comm               # the training ranks' communicator
    rank: int
    world: int                   # ranks that train (spares excluded)
    plan: ShardPlan              # who reads which rows
    params: np.ndarray           # the flat parameters (trainable first, then buffers)
    n_trainable: int
    per_sample: int              # predictions per sample (a token model's positions)
    bucket: FusedBucket          # the one fused bucket the step sums
    optimizer: Optimizer
    state: StepCounter
    base_lr: float
    steps_per_epoch: int

    @property
    def step(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def step_in_epoch(self) -> int: ...

    @property
    def is_spare(self) -> bool: ...

    def batch(self, position: int) -> tuple[np.ndarray, np.ndarray]: ...

    def lr_at(self, step: int) -> float: ...

    def apply_gradient(self, grad: np.ndarray, lr: float, grad_scale: float = 1.0) -> float: ...

    def apply_gradient_ok(self) -> None: ...

    def note_skip(self) -> None: ...

    def load_optimizer_state(self, state: dict) -> None: ...


class StepLanes(Protocol):
    """The rank's lane set (`runtime.lanes.LaneSet`; a pipelined rank's `PipelineLaneSet`)."""

    counted: tuple               # a weighted loss's (label weight, labelled count) of the last step

    @property
    def overlap_capable(self) -> bool: ...

    def step(self, x: np.ndarray, y: np.ndarray, seed: int,
             on_grad_ready: Callable[[str], None] | None = None) -> tuple[int, float, float, float]: ...

    def refresh_device_params(self) -> None: ...


class StepHooks(Protocol):
    """debug.* (`injection.DebugHooks`): each does nothing unless it names this rank."""

    slowdown: SlowdownInjector

    def fail_at(self, point: str, step: int | None = None) -> None: ...

    def poisons_gradient(self, step: int) -> bool: ...


class Loop(Protocol):
    """What a policy's step may use of the run (and nothing more)."""

    worker: LoopWorker
    lanes: StepLanes
    rank: int
    on_nonfinite: str   # train.on_nonfinite: "stop" or "skip"
    hooks: StepHooks

    def dropout_seed(self) -> int:
        """The seed of this step's dropout masks."""

    def reduce(self, nonfinite: bool, reduction=None) -> tuple[Mapping[str, bool], float]:
        """The step's one collective: this rank's control flags into the bucket's tail
        (`write_flags`), then the bucket's Allreduce (by `reduction`, else the bucket's own
        path). Returns the reduced flags and the seconds it took."""

    def restore_point(self, agreed: np.ndarray) -> None:
        """Every rank holds the same model here (a windowed sync's end): `agreed`, the array that
        holds it until the next one. Where the run survives a dead rank, a recovery goes back to
        it and to this rank's optimizer state as it is now; elsewhere nothing is kept."""

    def write_flags(self, nonfinite: bool) -> None:
        """This rank's control flags into the bucket's tail (the only place they are written),
        for a policy that sums the tail itself (a streaming sync, `policies/streaming.py`)."""
