"""The value checkers: one family for every setting anyone checks (the config schema, the
policies' `policy.*` keys, the model builders, the optimizers and schedules).

A check is a test of one value and what the value must be; a failed check is a ConfigError
`<label> <must>, got <value!r>`, where `label` is however the caller names the setting
(`train.epochs`, `policy.anchor`, `hidden`, `sgd: momentum`). Checks are type-safe on purpose:
any value a command line can produce fails the test, never raises a TypeError. Pure: no MPI,
no I/O; any layer may use it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

from hpc_rlx.base.errors import ConfigError


# Every integer setting ends up in a 64-bit slot somewhere (NumPy, HDF5 attributes, TensorBoard's
# hyper-parameters); a larger Python int passes a range check and fails later, far from the key.
INT64_MAX = 2**63 - 1
INT64_MIN = -2**63
TOO_LARGE = f"must be at most 2**63 - 1 ({INT64_MAX})"


def is_int(v) -> bool:
    """A Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_integral(v) -> bool:
    """Any integral number (NumPy's too) that is not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite real number (bools, strings, NaN and Inf are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_real(v) -> bool:
    """Any real number (NumPy's too, NaN and Inf included) that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class Check:
    """`test(value)` or ConfigError `<label> <must>, got <value!r>`."""

    def __init__(self, test: Callable[[Any], bool], must: str):
        self.test, self.must = test, must

    def __call__(self, label: str, value, world_size: int | None = None) -> None:
        if not self.test(value):
            raise ConfigError(self.message(label, value))

    def message(self, label: str, value) -> str:
        return f"{label} {self.must}, got {value!r}"


class OneOf(Check):
    """One of `choices`: `<label>=<value!r> is not one of <choices>`."""

    def __init__(self, *choices):
        super().__init__(lambda v: v in choices, f"is one of {choices}")
        self.choices = choices

    def message(self, label: str, value) -> str:
        return f"{label}={value!r} is not one of {self.choices}"


class Via(Check):
    """A check that lives with the code that interprets the value: `fn(value, world_size)`
    raises ConfigError itself."""

    def __init__(self, fn: Callable[[Any, int | None], Any], must: str):
        super().__init__(lambda v: True, must)
        self.fn = fn

    def __call__(self, label: str, value, world_size: int | None = None) -> None:
        self.fn(value, world_size)


def fits_int64(v) -> bool:
    """Anything but an int outside a signed 64-bit integer's range."""
    return not is_int(v) or INT64_MIN <= v <= INT64_MAX


class _Integer(Check):
    """An int check whose message for a too-large int names the bound, not the minimum."""

    def message(self, label: str, value) -> str:
        if is_int(value) and value > INT64_MAX:
            return f"{label} {TOO_LARGE}, got {value!r}"
        return super().message(label, value)


INT64 = _Integer(fits_int64, f"must be at least -2**63 ({INT64_MIN})")
"""Any key: an int value a 64-bit slot holds (the schema checks every key with it)."""


def integer(minimum: int, *, null: bool = False, must: str | None = None) -> Check:
    """An int >= `minimum` and <= 2**63 - 1 (or None with `null`)."""
    if must is None:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        must = f"must be null or {what}" if null else f"must be {what}"
    return _Integer(lambda v: (null and v is None) or (is_int(v) and minimum <= v <= INT64_MAX), must)


def number(minimum: float, *, above: bool = False, null: bool = False, must: str | None = None) -> Check:
    """A finite number >= `minimum` (> with `above`; or None with `null`)."""
    if must is None:
        must = f"must be {'null or ' if null else ''}{'>' if above else '>='} {minimum:g}"
    return Check(lambda v: (null and v is None)
                 or (is_number(v) and (v > minimum if above else v >= minimum)), must)


BOOL = Check(lambda v: isinstance(v, bool), "must be true or false")
"""A YAML boolean: `no`, `yes`, `0` or `"false"` would be a string or a number, and a string
passed on as truthy would turn a switch on."""

OPEN_UNIT = Check(lambda v: isinstance(v, (int, float)) and 0 < v < 1, "must be in (0, 1)")
"""A number strictly between 0 and 1 (a target share)."""


def at_least(minimum: int) -> Check:
    """An int >= `minimum`: `<label> must be an integer >= <minimum>`."""
    return integer(minimum, must=f"must be an integer >= {minimum}")


def checked(check: Check, label: str, value):
    """`value` after `check` passed it (for callers that use the value on the same line)."""
    check(label, value)
    return value
