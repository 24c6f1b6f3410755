"""`report.tensorboard`: `auto` (write event files when tensorboardX is installed), `true` (an
error when it is not), `false`. The setting's check lives here, with the schema that declares the
key; the writer (`hpc_rlx.observe.tensorboard_log`) uses the same import."""

from __future__ import annotations

import functools
import sys

from hpc_rlx.base.errors import ConfigError

SETTINGS = ("auto", "true", "false")
INSTALL_HINT = "pip install tensorboardX (or install hpc_rlx with the [report] extra)"


def normalize_setting(value) -> str:
    """report.tensorboard as one of SETTINGS (YAML gives booleans for true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and value.lower() in SETTINGS:
        return value.lower()
    raise ConfigError(f"report.tensorboard={value!r} is not one of auto, true, false")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import_writer()
    except ImportError:
        return False
    return True


def import_writer():
    """tensorboardX's writer and hparams, without torch. tensorboardX imports torch when it
    can (only to accept torch tensors, which hpc_rlx never passes); in a venv that has torch
    that costs ~5 s of rank 0's startup. A `None` entry in sys.modules makes that optional
    import fail fast, as if torch were absent, for the duration of the import only."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None       # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter, hparams


def enabled(value) -> bool:
    """Whether to write event files; `true` without tensorboardX is a ConfigError."""
    setting = normalize_setting(value)
    if setting == "false":
        return False
    if setting == "true" and not available():
        raise ConfigError(f"report.tensorboard=true, but tensorboardX is not installed: "
                          f"{INSTALL_HINT}, or set report.tensorboard=auto|false")
    return available()
