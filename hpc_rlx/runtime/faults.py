"""Injected failures (debug.fail_rank / fail_point / fail_step), to exercise the failure paths."""

from __future__ import annotations


class InjectedFailure(RuntimeError):
    """Raised by debug.fail_* to exercise the failure paths in tests."""


class Faults:
    """debug.fail_* of one rank, as an object the loops call at each failure point. Without
    debug.fail_* asking for this rank, `at` does nothing (`NoFaults`)."""

    @staticmethod
    def for_rank(spec, rank: int) -> "Faults":
        dbg = spec.debug
        if dbg["fail_point"] is None or dbg["fail_rank"] is None or int(dbg["fail_rank"]) != rank:
            return NO_FAULTS
        return Faults(spec, rank)

    def __init__(self, spec, rank: int):
        self.spec, self.rank = spec, rank

    def at(self, point: str, step: int | None = None) -> None:
        maybe_fail(self.spec, self.rank, point, step)


class NoFaults(Faults):
    def __init__(self):
        pass

    def at(self, point: str, step: int | None = None) -> None:
        pass


NO_FAULTS = NoFaults()


def maybe_fail(spec, rank: int, point: str, step: int | None = None) -> None:
    """Raise InjectedFailure if `spec.debug` (a TrainSpec's) asks for one here."""
    dbg = spec.debug
    if dbg["fail_point"] != point or dbg["fail_rank"] is None or int(dbg["fail_rank"]) != rank:
        return
    if step is not None and step != int(dbg["fail_step"] or 0):
        return
    raise InjectedFailure(f"injected failure (debug.fail_point={point})")
