"""What `comm.on_failure` means, read once per run: `abort` (the default: a dead rank ends the
job), `shrink` (the survivors train on) or `spare` (a spare takes a dead rank's shard). Every
part of the run asks a `FailureMode`; none reads the key itself (the config's checks of what
it runs with, `config/failure_mode.py`, are the schema's)."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.config.failure_mode import on_failure_of, training_ranks

MODES = {"abort": "a rank that dies ends the job (resume from the last checkpoint)",
         "shrink": "a rank that dies is dropped, the survivors train on (MPI's ULFM)",
         "spare": "a rank that dies is replaced by a spare, which takes its shard (MPI's ULFM)"}


@dataclass(frozen=True)
class FailureMode:
    """One run's `comm.on_failure` (`name`) and its `comm` section (for `comm.spares`)."""
    name: str
    comm: dict

    @classmethod
    def of(cls, comm_section) -> "FailureMode":
        """From a spec's (or a config's) `comm` section."""
        return cls(on_failure_of(comm_section), dict(comm_section))

    @property
    def active(self) -> bool:
        """Whether a dead rank is survived (shrink or spare), by MPI's ULFM."""
        return self.name != "abort"

    @property
    def has_spares(self) -> bool:
        return self.name == "spare"

    def training_ranks(self, ranks: int) -> int:
        """Of `ranks` ranks, the ones that train (`comm.spares` fewer under spare)."""
        return training_ranks(self.comm, ranks)

    def spares_after(self, dead: int) -> int | None:
        """The spares left once `dead` ranks died before training (each takes a spare with it);
        None under shrink, which counts none."""
        return max(0, int(self.comm.get("spares") or 0) - dead) if self.has_spares else None

    def describe(self) -> str:
        return f"comm.on_failure={self.name}: {MODES[self.name]}"


def is_spare(rank: int, training: int) -> bool:
    """Whether `rank` is a spare (comm.on_failure=spare): the ranks past the `training` ones
    hold the model, take part in every collective with no rows, and train nothing until one
    takes a dead rank's place."""
    return rank >= training
