"""Injected failures (debug.fail_rank / fail_point / fail_step), to exercise the failure paths."""

from __future__ import annotations


class InjectedFailure(RuntimeError):
    """Raised by debug.fail_* to exercise the failure paths in tests."""


def maybe_fail(spec, rank: int, point: str, step: int | None = None) -> None:
    """Raise InjectedFailure if `spec.debug` (a TrainSpec's) asks for one here."""
    dbg = spec.debug
    if dbg["fail_point"] != point or dbg["fail_rank"] is None or int(dbg["fail_rank"]) != rank:
        return
    if step is not None and step != int(dbg["fail_step"] or 0):
        return
    raise InjectedFailure(f"injected failure (debug.fail_point={point})")
