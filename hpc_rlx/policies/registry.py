"""Every policy, by the name `policy=NAME` selects. A new policy is one module and one line here."""

from __future__ import annotations

from .asynchronous import AsyncPolicy
from .base import Policy
from .cadence import CadencePolicy
from .sync import SyncPolicy

POLICIES: dict[str, type[Policy]] = {
    "sync": SyncPolicy,
    "cadence": CadencePolicy,
    "async": AsyncPolicy,
}


def make_policy(spec) -> Policy:
    """The policy object for `spec.policy.name` (already validated while the spec was built)."""
    return POLICIES[spec.policy["name"]](spec)
