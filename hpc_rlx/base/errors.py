"""Error types users see. Each one is printed as a single clear line, the same on every rank.

Everything the user can fix (config, data, graph file, checkpoint, disk) raises a subclass of
HpcRlxError; anything else is a bug and is reported with its traceback.

`phase(name)` marks what a rank is doing ("data loading", "checkpointing", ...): an exception
leaving the block carries the innermost phase it passed through, which the failure message
names. The code that enters a phase says so; renaming a function changes nothing users see.
"""

from __future__ import annotations

from contextlib import contextmanager


class HpcRlxError(Exception):
    """Base class for errors caused by the user's input or environment, not by a bug."""


class ConfigError(HpcRlxError):
    """The composed config is invalid (unknown key, bad value, impossible combination).

    Library code (a model builder, an optimizer, an lr schedule) names its own parameters: its
    error about one is made by `bad_param` and carries the parameter's name (`key`) and the rest
    of the message (`detail`), so a caller that knows which config key the parameter comes from
    restates it (`restated`: `dropout must be in [0, 1)` -> `model.dropout must be in [0, 1)`).
    The class stays ConfigError: its name is the kind every rank prints."""

    key: str | None = None      # the library parameter the message is about (bad_param), else None
    detail: str = ""            # the message after the parameter's name: ` must be ...`, `[0] must ...`
    where: str = ""             # whose parameter it is (`sgd`, `lr schedule 'step'`); "" for a model's

    @classmethod
    def bad_param(cls, key: str, detail: str, where: str = "") -> "ConfigError":
        """`<where>: <key><detail>` (`<key><detail>` without `where`), with its parts kept."""
        err = cls(f"{where}: {key}{detail}" if where else f"{key}{detail}")
        err.key, err.detail, err.where = key, detail, where
        return err

    def restated(self, section: str) -> "ConfigError":
        """The same error named by its config key: `<section>.<key><detail>`."""
        if self.key is None:
            raise ValueError("only an error made by ConfigError.bad_param names a parameter")
        return ConfigError(f"{section}.{self.key}{self.detail}")


def check_param(check, key: str, value, where: str = "", qualifier: str = ""):
    """`value` after `check` (an `hpc_rlx.base.checks.Check` that tests the value) passed it, else
    `ConfigError.bad_param(key, <qualifier><the check's message after its label>, where)`:
    `sgd: momentum must be a number in [0, 1), got 2`; with ``qualifier="[0]"``,
    `adamw: betas[0] must be ...`; with ``qualifier=" (C, H, W)"``, `input_shape (C, H, W) must ...`."""
    if not check.test(value):
        raise ConfigError.bad_param(key, qualifier + check.message("", value), where)
    return value


class DataError(HpcRlxError):
    """The HDF5 training data cannot be used (missing, wrong shape, bad labels, ...)."""


class GraphError(HpcRlxError):
    """The model graph is invalid; the message names the offending node."""


class CheckpointError(HpcRlxError):
    """A checkpoint cannot be written or read (corrupt, from another model, disk full)."""


class DeviceError(HpcRlxError):
    """A requested device/backend is not available on this rank."""


@contextmanager
def phase(name: str):
    """Tag an exception raised inside the block with `name`, unless an inner phase did."""
    try:
        yield
    except BaseException as exc:
        if getattr(exc, "phase", None) is None:
            try:
                exc.phase = name
            except AttributeError:
                pass        # an exception type that takes no attributes: the caller's default
        raise


def phase_of(exc: BaseException, default: str) -> str:
    return getattr(exc, "phase", None) or default
