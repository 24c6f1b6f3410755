"""Streaming outer syncs (Streaming DiLoCo, Douillard et al., 2025): the schedule, pure (no MPI).

`policy.fragments=F` cuts the parameter vector into F contiguous fragments of nearly equal size.
With K local steps per sync (`policy.anchor`), every rank runs sub-windows of K / F steps, and
the sync that ends sub-window j carries fragment ``j mod F`` (and the report every sync carries):
each fragment syncs every K steps, offset by K / F from the fragment before it. That order is
the default schedule, ``policy.fragment_schedule=round_robin``; another reorders each cycle of
F syncs (`fragment_schedule`). Its sum is
started without blocking and applied ``policy.fragment_delay`` (tau) steps into the next
sub-window, while those steps run: the fragment's outer step, then the rank's own copy of the
fragment merged with the new global one, ``local = mix * local + (1 - mix) * global``
(``policy.fragment_mix``; the paper's 0.5 by default when tau > 0; with tau = 0 nothing local has
happened since the send and the global fragment replaces the local one, as in DiLoCo).

Which schedule: every rank must send fragment j at the same sub-window, so the sub-windows must
have the same number of steps on every rank and must not move. Fragments therefore run with
`policy=async` and `policy.tune=false`, and F must divide K (`check_streaming`); `cadence`,
whose ranks run different numbers of steps, and a tuned K are refused. The epoch's last
sub-window waits for its sum at once, so validation and the epoch's checkpoint see every
fragment applied.

F = 1 with tau = 0 is DiLoCo as before: one sync of everything every K steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlx.base.checks import checked, integer
from hpc_rlx.base.even_split import segments

from hpc_rlx.base.errors import ConfigError

from .fragment_schedule import DEFAULT as DEFAULT_SCHEDULE, check_schedule

PAPER_MIX = 0.5      # Streaming DiLoCo's mixing factor for overlapped syncs


def fragment_bounds(n: int, fragments: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``fragments`` contiguous ranges, the first ones one longer when the
    division leaves a rest (the cut of the wire's segments, `base.even_split.segments`)."""
    return segments(n, fragments)


@dataclass(frozen=True)
class Streaming:
    """The checked streaming keys of a windowed policy."""

    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    schedule: str = DEFAULT_SCHEDULE    # the order of the fragments (`fragment_schedule`)

    @property
    def active(self) -> bool:
        """Whether the syncs stream (F > 1 or a delay); else the one whole sync of DiLoCo."""
        return self.fragments > 1 or self.delay > 0

    def sub_window(self, k: int) -> int:
        """Local steps between two fragment syncs."""
        return int(k) // self.fragments


_COUNT = integer(1, must="must be an integer >= 1")
_DELAY = integer(0, must="must be an integer >= 0")


def check_streaming(cfg: dict, policy: str) -> dict:
    """``policy.fragments``, ``policy.fragment_delay``, ``policy.fragment_mix`` and
    ``policy.fragment_schedule`` checked against the policy they run under; returns them
    normalised (the mix resolved)."""
    fragments = checked(_COUNT, "policy.fragments", _integral(cfg.get("fragments", 1)))
    delay = checked(_DELAY, "policy.fragment_delay", _integral(cfg.get("fragment_delay", 0)))
    mix = cfg.get("fragment_mix")
    if mix is not None:
        if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
            raise ConfigError(f"policy.fragment_mix must be a number in [0, 1] or null, got {mix!r}")
        mix = float(mix)
    out = {"fragments": fragments, "fragment_delay": delay,
           "fragment_mix": (PAPER_MIX if delay > 0 else 0.0) if mix is None else mix,
           "fragment_schedule": check_schedule(cfg.get("fragment_schedule", DEFAULT_SCHEDULE))}
    if fragments == 1 and delay == 0:
        return out
    what = f"policy.fragments={fragments} policy.fragment_delay={delay}"
    if policy != "async":
        raise ConfigError(f"{what} needs every rank on the same steps per sync: use policy=async "
                          f"with policy.tune=false (policy={policy} runs different numbers of steps per rank)")
    if cfg.get("tune", True):
        raise ConfigError(f"{what} needs a fixed K: set policy.tune=false (a tuned K would move "
                          f"the fragments' schedule)")
    k = int(cfg["anchor"])
    if k % fragments:
        raise ConfigError(f"{what}: policy.fragments must divide policy.anchor (K={k}), so every "
                          f"fragment syncs every K steps")
    if delay > k // fragments:
        raise ConfigError(f"policy.fragment_delay={delay} is longer than the {k // fragments} steps "
                          f"between two fragment syncs (K={k} / F={fragments}): at most {k // fragments}")
    return out


def _integral(value):
    # Hydra hands `fragments: 2.0` through as a float; accept integral floats, refuse 2.5
    return int(value) if isinstance(value, float) and value.is_integer() else value


__all__ = ["PAPER_MIX", "Streaming", "check_streaming", "fragment_bounds"]
