"""The windowed policies' shared `policy.*` keys, their docs, and the `policy.*` readers every
policy's `check_config` uses, on the package's checkers (`hpc_rlx.base.checks`; pure: no MPI)."""

from __future__ import annotations

from hpc_rlx.base.checks import INT64_MIN, Check, checked, integer
from hpc_rlx.comm.quant_codec import normalize_outer_wire

from .fragment_schedule import DEFAULT as DEFAULT_SCHEDULE
from .outer import outer_from_config

SHARED_DEFAULTS = {
    "anchor": 10,
    "max_anchor": 200,
    "overhead_target": 0.10,
    "gamma": -1.0,
    "outer": "average",
    "outer_lr": None,
    "outer_momentum": None,
    "outer_warmup": None,
    "reset_inner": False,
    "outer_wire_dtype": None,
    "fragments": 1,
    "fragment_delay": 0,
    "fragment_mix": None,
    "fragment_schedule": DEFAULT_SCHEDULE,
}
SHARED_DOCS = {
    "anchor": "initial local steps per sync (cadence: of the slowest rank; async: K)",
    "max_anchor": "upper bound of the anchor",
    "overhead_target": "target sync time / compute time that the anchor is tuned to",
    "gamma": "consensus weight of a rank = (its local steps) ** gamma; -1 = each rank's move "
             "divided by its steps, so every shard counts as in sync (measured: bench/README.md); "
             "0 = plain mean; 1 = weighted by work",
    "outer": "`average`, `diloco` (outer Nesterov momentum on the pseudo-gradient) or `slowmo` "
             "(slow momentum)",
    "outer_lr": "outer step size; null = the method's default (diloco 0.7, slowmo 1.0)",
    "outer_momentum": "outer momentum; null = the method's default (diloco 0.9, slowmo 0.5)",
    "outer_warmup": "syncs of plain averaging before the outer momentum starts; null = the "
                    "method's default (diloco 18, measured: bench/README.md; slowmo 0)",
    "reset_inner": "true: reset every rank's inner optimizer state after each sync; false keeps "
                   "it, as the DiLoCo paper's workers do",
    "outer_wire_dtype": "null (the compute dtype) | bfloat16 | float16 | int8 | int4: each rank "
                        "sends its weighted difference from the agreed model in this code, with "
                        "error feedback (what rounding drops is sent at the next sync)",
    "fragments": "F: the parameters cut into F fragments, each synced every K steps, offset by "
                 "K/F from the one before (Streaming DiLoCo; F > 1: policy=async, tune=false, F "
                 "divides K)",
    "fragment_delay": "tau: a fragment's sum is applied tau local steps after it is sent, "
                      "overlapping them (at most K/F)",
    "fragment_mix": "a rank's fragment after the sum arrives = mix * its own + (1 - mix) * the "
                    "global one; null = 0.5 with a delay (the paper's), else 0",
    "fragment_schedule": "the order in which the fragment syncs carry the fragments, each once every K "
                         "steps: `round_robin` (0, 1, ..., F-1; the schedules: "
                         "hpc_rlx/policies/fragment_schedule.py)",
}


def check_outer_keys(cfg: dict) -> dict:
    """The outer optimizer's keys, checked (the ranges by building it once)."""
    out = {"outer": cfg["outer"],
           "outer_lr": number_key("outer_lr", cfg["outer_lr"], allow_none=True),
           "outer_momentum": number_key("outer_momentum", cfg["outer_momentum"], allow_none=True),
           "outer_warmup": integer_key("outer_warmup", cfg["outer_warmup"], allow_none=True),
           "reset_inner": bool_key("reset_inner", cfg["reset_inner"]),
           "outer_wire_dtype": normalize_outer_wire(cfg["outer_wire_dtype"])}
    outer_from_config(out)
    return out


def round_or_none(x, digits: int = 5):
    return None if x is None else round(float(x), digits)


_NUMBER = Check(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "must be a number")
_BOOL = Check(lambda v: isinstance(v, bool), "must be true or false")
_INTEGER = integer(INT64_MIN, must="must be an integer")


def number_key(name: str, value, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    return float(checked(_NUMBER, f"policy.{name}", value))


def bool_key(name: str, value) -> bool:
    return checked(_BOOL, f"policy.{name}", value)


def integer_key(name: str, value, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    # Hydra hands `anchor: 10.0` through as a float; accept integral floats, refuse 2.5
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return checked(_INTEGER, f"policy.{name}", value)
