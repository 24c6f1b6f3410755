"""Checkpoints: atomic HDF5 files written by rank 0, keep-last plus best retention, resume discovery.

- `h5file`: the file layout, checksum, reading and verification;
- `retention`: which checkpoints to keep (pure bookkeeping);
- `manager`: `CheckpointManager`, the atomic save protocol and the choice of what to resume.

Typical use on rank 0::

    mgr = CheckpointManager(checkpoints_dir(run_dir), keep_last=2, metric="val_loss")
    state = mgr.load_latest()                  # resume=auto; or read_checkpoint(PATH)
    if state is not None:
        check_compatible(state, graph_fingerprint)
        mgr.restore_history(state)
    ...
    mgr.save(CheckpointState(arrays, meta), step, metric_value=val_loss)
"""

from hpc_rlx.checkpoint.h5file import (
    BEST_POINTER,
    FORMAT,
    FORMAT_VERSION,
    POINTER,
    CheckpointState,
    check_compatible,
    checkpoint_name,
    checkpoints_dir,
    read_checkpoint,
    verify_checkpoint,
)
from hpc_rlx.checkpoint.manager import CheckpointManager
from hpc_rlx.checkpoint.retention import BestTracker, metric_mode, plan_deletions

__all__ = [
    "BEST_POINTER", "FORMAT", "FORMAT_VERSION", "POINTER", "BestTracker",
    "CheckpointManager", "CheckpointState", "check_compatible", "checkpoint_name",
    "checkpoints_dir", "metric_mode", "plan_deletions", "read_checkpoint", "verify_checkpoint",
]
