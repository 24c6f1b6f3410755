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
    """The composed config is invalid (unknown key, bad value, impossible combination)."""


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
