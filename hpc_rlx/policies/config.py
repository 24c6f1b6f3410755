"""`policy.*` keys: checked against the selected policy's own declaration (pure, no MPI).

`validate_policy_config` is meant to run on rank 0 while the spec is built, so a bad value
fails once, before any rank trains; the windowed policies check again on every rank (cheap)
so a spec built by other means is checked too. Each policy class declares its keys and
defaults (`Policy.defaults`) and checks them (`Policy.check_config`); the range checks are the
constructors of the scheduler, the interval controller and the outer optimizer, so each rule
lives in one place.
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import checked_name
from .registry import POLICIES

POLICY_NAMES = tuple(POLICIES)


def validate_policy_config(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Check `policy.*` and return it complete (defaults filled in, numbers normalised).

    Raises ConfigError naming the key and the offending value, for an unknown policy name, a
    key that does not belong to that policy, or a value out of range.
    """
    return POLICIES[checked_name(policy, POLICY_NAMES)].complete_config(policy)


def build_controller(cfg: Mapping[str, Any], world_size: int):
    """The step-count controller of a validated config: ElChe for cadence, K for async."""
    return POLICIES[checked_name(cfg, POLICY_NAMES)].build_controller(cfg, world_size)
