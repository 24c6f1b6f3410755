"""`policy.fragment_schedule`: the order in which the streaming syncs carry the fragments (pure).

A schedule is a function of the fragments' sizes (`fragments.fragment_bounds`) that returns the
order of one cycle of F syncs: a permutation of ``range(F)``. The syncs run that cycle again
and again, so every fragment syncs once every K steps whatever the order; the sync after
sub-window ``s`` (counted from the run's start) carries ``order[s mod F]`` on every rank. A new
schedule is one function and one line in `SCHEDULES`; ``policy.fragment_schedule=NAME`` selects it.
"""

from __future__ import annotations

from typing import Callable

from hpc_rlx.base.errors import ConfigError


def round_robin(sizes: list[int]) -> list[int]:
    """Fragment 0, 1, ..., F - 1: each one K / F steps after the one before (Streaming DiLoCo)."""
    return list(range(len(sizes)))


SCHEDULES: dict[str, Callable[[list[int]], list[int]]] = {
    "round_robin": round_robin,
}

DEFAULT = "round_robin"


def check_schedule(name) -> str:
    """``policy.fragment_schedule``, checked: a registered schedule's name."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ConfigError(f"policy.fragment_schedule must be one of {tuple(SCHEDULES)}, got {name!r}")
    return name


def cycle_order(name: str, bounds: list[tuple[int, int]]) -> tuple[int, ...]:
    """The fragments of one cycle of syncs, in the order schedule `name` gives for these bounds."""
    order = tuple(int(j) for j in SCHEDULES[check_schedule(name)]([hi - lo for lo, hi in bounds]))
    if sorted(order) != list(range(len(bounds))):
        raise ConfigError(f"policy.fragment_schedule={name} gave {list(order)} for {len(bounds)} fragments: "
                          f"each fragment once per cycle")
    return order
