"""A run's failure, typed: what `runtime.train.train` raises (`RunFailed`) instead of
attributes stuck on the exception. The start-up recovery asks it whether training had begun
and how to abandon the node's shared window; the command's error message names its step and
what the rank was doing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpc_rlx.base.errors import phase_of

# The run's stages, in order: before `train` (the spec, the start-up hooks), its set-up, the
# epochs, and its last one (the final gather and summary: debug.fail_point=finish)
STARTUP, SETUP, TRAINING, FINISH = "startup", "setup", "training", "finish"
PHASES = (STARTUP, SETUP, TRAINING, FINISH)


@dataclass(frozen=True)
class RunFailure:
    """`cause`: the exception; `step`: where training was (None: no worker yet); `phase`: the
    run's stage (`PHASES`); `abandon`: the node's shared window's way out (the bucket's
    `abandon_node_memory`), None where there is no bucket."""
    cause: BaseException
    step: int | None = None
    phase: str = STARTUP
    abandon: Callable[[], bool] | None = None

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"unknown run phase {self.phase!r}, not one of {PHASES}")

    @property
    def before_training(self) -> bool:
        """No step was taken yet: the survivors of a dead rank can start the run over."""
        return self.phase in (STARTUP, SETUP)

    @property
    def doing(self) -> str:
        """What the rank was doing, for the message: the innermost `errors.phase`, else the
        start-up or training."""
        return phase_of(self.cause, STARTUP if self.phase == STARTUP else TRAINING)


class RunFailed(Exception):
    """The exception that carries a `RunFailure` out of `train` (its cause chained)."""

    def __init__(self, failure: RunFailure):
        super().__init__(str(failure.cause))
        self.failure = failure


def failure_of(exc: BaseException, phase: str = STARTUP) -> RunFailure:
    """`exc` as a failure: the one `RunFailed` carries, else one in `phase` (no step)."""
    return exc.failure if isinstance(exc, RunFailed) else RunFailure(exc, phase=phase)
