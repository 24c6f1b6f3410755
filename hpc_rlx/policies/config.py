"""`policy.*` keys: defaults, allowed keys per policy, and value checks (pure, no MPI).

`validate_policy_config` is meant to run on rank 0 while the spec is built, so a bad value
fails once, before any rank trains; the runners call it again on every rank (cheap) so a
spec built by other means is checked too. The value checks are the constructors of the
scheduler, the interval controller and the outer optimizer, so each rule lives in one place.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError

POLICY_NAMES = ("sync", "cadence", "async")

_SHARED = {
    "anchor": 10,
    "max_anchor": 200,
    "overhead_target": 0.10,
    "gamma": 1.0,
    "outer": "average",
    "outer_lr": None,
    "outer_momentum": None,
}

DEFAULTS: dict[str, dict[str, Any]] = {
    "sync": {},
    "cadence": dict(_SHARED, max_batch_diff=None),
    "async": dict(_SHARED, divergence_threshold=0.05),
}


def _number(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"policy.{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    # Hydra hands `anchor: 10.0` through as a float; accept integral floats, refuse 2.5
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"policy.{name} must be an integer, got {value!r}")
    return value


def validate_policy_config(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Check `policy.*` and return it complete (defaults filled in, numbers normalised).

    Raises ConfigError naming the key and the offending value, for an unknown policy name, a
    key that does not belong to that policy, or a value out of range.
    """
    if not isinstance(policy, Mapping):
        raise ConfigError(f"policy must be a mapping with a 'name', got {policy!r}")
    name = policy.get("name")
    if name not in POLICY_NAMES:
        raise ConfigError(f"policy={name!r} is not one of {POLICY_NAMES}")
    allowed = DEFAULTS[name]
    unknown = sorted(set(policy) - set(allowed) - {"name"})
    if unknown:
        raise ConfigError(f"policy={name} does not take {unknown}; its keys are "
                          f"{sorted(['name', *allowed])}")
    out: dict[str, Any] = {"name": name}
    if name == "sync":
        return out
    cfg = dict(allowed)
    cfg.update({k: v for k, v in policy.items() if k != "name"})
    out["anchor"] = _integer("anchor", cfg["anchor"])
    out["max_anchor"] = _integer("max_anchor", cfg["max_anchor"])
    out["overhead_target"] = _number("overhead_target", cfg["overhead_target"])
    out["gamma"] = _number("gamma", cfg["gamma"])
    out["outer"] = cfg["outer"]
    out["outer_lr"] = _number("outer_lr", cfg["outer_lr"], allow_none=True)
    out["outer_momentum"] = _number("outer_momentum", cfg["outer_momentum"], allow_none=True)
    if name == "cadence":
        out["max_batch_diff"] = _integer("max_batch_diff", cfg["max_batch_diff"], allow_none=True)
    else:
        out["divergence_threshold"] = _number("divergence_threshold", cfg["divergence_threshold"],
                                              allow_none=True)
    # The objects that enforce the ranges; built once here only for their checks.
    from .consensus import work_weight
    from .outer import make_outer

    work_weight(1, out["gamma"])
    make_outer(out["outer"], out["outer_lr"], out["outer_momentum"])
    build_controller(out, world_size=1)
    return out


def build_controller(cfg: Mapping[str, Any], world_size: int):
    """The step-count controller of a validated config: ElChe for cadence, K for async."""
    from .elche import ElcheScheduler
    from .interval import IntervalController

    if cfg["name"] == "cadence":
        return ElcheScheduler(world_size, anchor=cfg["anchor"], max_anchor=cfg["max_anchor"],
                              overhead_target=cfg["overhead_target"],
                              max_batch_diff=cfg["max_batch_diff"])
    if cfg["name"] == "async":
        return IntervalController(k=cfg["anchor"], max_anchor=cfg["max_anchor"],
                                  overhead_target=cfg["overhead_target"],
                                  divergence_threshold=cfg["divergence_threshold"])
    raise ConfigError(f"policy={cfg['name']!r} has no step-count controller")
