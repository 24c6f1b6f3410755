"""What a component offers the recovery when the ranks change: one method. A component that
holds state shaped by the ranks (a shard of the data, per-rank slots, a communicator, a
policy's window) implements `RankLossHook.rebuild`; the recovery calls it on every survivor,
in the order the run lists them (`rank_loss_hooks`: the parts of the run's context that offer
it), once the survivors hold the state they go on from. It does not ask `comm.on_failure`: it
is called only where a dead rank was survived. A new part that must survive a dead rank is
that one method."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Survivors:
    """The ranks that go on: their communicator (this rank's number in it: `comm.rank`), how
    many of them train (the first `training`; the rest are spares), the survivor whose state
    they all go on from (`source`, a rank of `comm`), and whether this rank writes the run
    directory from here on in place of a dead rank 0 (`new_writer`)."""
    comm: Any
    training: int
    source: int = 0
    new_writer: bool = False

    @property
    def rank(self) -> int:
        return self.comm.rank


@runtime_checkable
class RankLossHook(Protocol):
    """A component that survives a dead rank: one method."""

    def rebuild(self, survivors: Survivors) -> None:
        """Collective over `survivors.comm`: go on over the survivors as a resume on that many
        ranks would."""


def rank_loss_hooks(context) -> tuple[RankLossHook, ...]:
    """The parts of `context` (a dataclass: the run's `RunContext`) that rebuild over the
    survivors, in its field order (the worker first: the others read its new shard)."""
    parts = [getattr(context, f.name) for f in fields(context)]
    return tuple(part for part in parts if isinstance(part, RankLossHook))
