"""Error types users see. Each one is printed as a single clear line, the same on every rank.

Everything the user can fix (config, data, graph file, checkpoint, disk) raises a subclass of
HpcRlxError; anything else is a bug and is reported with its traceback.
"""


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
