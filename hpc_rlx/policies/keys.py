"""The windowed policies' shared `policy.*` keys, their docs, and the value checkers every
policy's `check_config` uses (pure: no MPI)."""

from __future__ import annotations

from ..errors import ConfigError

SHARED_DEFAULTS = {
    "anchor": 10,
    "max_anchor": 200,
    "overhead_target": 0.10,
    "gamma": 1.0,
    "outer": "average",
    "outer_lr": None,
    "outer_momentum": None,
}
SHARED_DOCS = {
    "anchor": "initial local steps per sync (cadence: of the slowest rank; async: K)",
    "max_anchor": "upper bound of the anchor",
    "overhead_target": "target sync time / compute time that the anchor is tuned to",
    "gamma": "consensus weight of a rank = (its local steps) ** gamma; 0 = plain mean",
    "outer": "`average`, `diloco` (outer Nesterov, inner state reset) or `slowmo` (slow momentum, "
             "inner state kept)",
    "outer_lr": "outer step size; null = the method's default (diloco 0.7, slowmo 1.0)",
    "outer_momentum": "outer momentum; null = the method's default (diloco 0.9, slowmo 0.5)",
}


def round_or_none(x, digits: int = 5):
    return None if x is None else round(float(x), digits)


def number_key(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"policy.{name} must be a number, got {value!r}")
    return float(value)


def bool_key(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"policy.{name} must be true or false, got {value!r}")
    return value


def integer_key(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    # Hydra hands `anchor: 10.0` through as a float; accept integral floats, refuse 2.5
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"policy.{name} must be an integer, got {value!r}")
    return value
