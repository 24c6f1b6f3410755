"""The run directory is made and written to before anything else runs: a directory that cannot
be written is one ConfigError on rank 0 (with the command line's check and again in the spec)."""

from __future__ import annotations

import os
from pathlib import Path

from hpc_rlx.base.errors import ConfigError


def check_run_dir_writable(run_dir: str) -> None:
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run directory {run_dir} is not writable: {e.strerror or e}") from e
