"""`debug.*`: failures and slowness injected on purpose, to exercise the failure paths and to
simulate mixed hardware on one machine. The one place that reads the `debug` section.

`DebugHooks.for_rank(spec, rank, world_size)` reads it once per rank; the run asks it at each
injection point and it does nothing unless a key names this rank:

- `fail_at(point, step)`: `debug.fail_*` raises `InjectedFailure` at `startup`, `broadcast`, `data`, `step`,
  `allreduce`, `validation` or `checkpoint` (at step `fail_step` for the three with a step), or
  `recovery` (`fail_rank=[a, b, ...]`: rank a fails at `step` `fail_step`, the others in the
  recovery from it, once the survivors have shrunk); with
  `debug.fail_mode=kill` the rank sends itself SIGKILL there instead (a dead rank);
- `poisons_gradient(step)`: `debug.nan_*`, this rank puts a NaN into its gradient;
- `stall`: `debug.stall_*`, how the stall watchdog makes this rank late at its collectives;
- `slowdown`: `debug.slowdown`, this rank's `SlowdownInjector` (`injection.slowdown`).

Pure Python: no MPI, no files.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Mapping

from .slowdown import SlowdownInjector, parse_slowdown, slowdown_for_rank



FAIL_MODES = ("raise", "kill")
# where debug.fail_point can strike, in the order a run meets them (docs/config.md has each)
FAIL_POINTS = ("spec", "startup", "broadcast", "data", "scatter", "step", "recovery", "allreduce",
               "validation", "checkpoint", "finish")


def fail_keys_from_command_line(argv) -> dict:
    """The `debug.fail_*` overrides of a command line, as values (`debug.fail_rank=[1,2]` ->
    [1, 2]): what a rank other than 0 knows of them before it holds the spec
    (debug.fail_point=spec)."""
    out = {}
    for arg in argv:
        key, eq, value = str(arg).partition("=")
        if eq and key.startswith("debug.fail_"):
            try:        # JSON covers the values these keys take: 2, [1,2], null; else a word
                out[key[len("debug."):]] = json.loads(value)
            except ValueError:
                out[key[len("debug."):]] = value.strip("'\"")
    return out


def spec_failure_hooks(argv, rank: int) -> "DebugHooks | None":
    """A rank other than 0's hooks from its command line (None where the values do not read:
    the spec's own check on rank 0 names them)."""
    try:
        return DebugHooks.from_section(fail_keys_from_command_line(argv), rank)
    except (TypeError, ValueError):
        return None


def _first(failing) -> int:
    return int(failing[0]) if isinstance(failing, (list, tuple)) else int(failing)


class InjectedFailure(RuntimeError):
    """Raised by debug.fail_* to exercise the failure paths in tests."""


@dataclass(frozen=True)
class StallPlan:
    """debug.stall_*: from global step `step` on, this rank arrives `seconds` late at the first
    watched collective."""
    step: int
    seconds: float


@dataclass
class DebugHooks:
    rank: int
    fail_point: str | None = None
    fail_step: int = 0
    fail_mode: str = "raise"
    nan_step: int | None = None
    stall: StallPlan | None = None
    slowdown: SlowdownInjector = field(default_factory=SlowdownInjector)

    @classmethod
    def for_rank(cls, spec, rank: int, world_size: int | None = None) -> "DebugHooks":
        """This rank's hooks from a TrainSpec (or anything with a `debug` mapping)."""
        return cls.from_section(spec.debug, rank, world_size)

    @classmethod
    def from_section(cls, debug: Mapping, rank: int, world_size: int | None = None) -> "DebugHooks":
        mine = lambda key: debug.get(key) is not None and int(debug[key]) == rank   # noqa: E731
        failing = debug.get("fail_rank")    # one rank, or a list of ranks failing together
        fails_here = failing is not None and rank in (
            [int(r) for r in failing] if isinstance(failing, (list, tuple)) else [int(failing)])
        hooks = cls(rank=rank, slowdown=slowdown_for_rank(debug.get("slowdown"), rank, world_size))
        if fails_here and debug.get("fail_point") is not None:
            hooks.fail_point, hooks.fail_step = str(debug["fail_point"]), int(debug.get("fail_step") or 0)
            hooks.fail_mode = str(debug.get("fail_mode") or "raise")
            if hooks.fail_point == "recovery" and rank == _first(failing):
                hooks.fail_point = "step"       # the failure the others then die recovering from
        if mine("nan_rank"):
            hooks.nan_step = int(debug.get("nan_step") or 0)
        if mine("stall_rank") and debug.get("stall_s"):
            hooks.stall = StallPlan(step=int(debug.get("stall_step") or 0), seconds=float(debug["stall_s"]))
        return hooks

    def fail_at(self, point: str, step: int | None = None) -> None:
        """Raise InjectedFailure if debug.fail_* asks for one here (`step`: at `step` points)."""
        if self.fail_point != point:
            return
        if step is not None and step != self.fail_step:
            return
        if self.fail_mode == "kill":
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)      # a dead rank: no handler, no message
        raise InjectedFailure(f"injected failure (debug.fail_point={point})")

    def poisons_gradient(self, step: int) -> bool:
        """Whether debug.nan_* puts a NaN into this rank's gradient at global step `step`."""
        return self.nan_step is not None and self.nan_step == step


__all__ = ["DebugHooks", "FAIL_MODES", "InjectedFailure", "SlowdownInjector", "StallPlan",
           "parse_slowdown", "slowdown_for_rank"]
