"""The data files a checkpoint was trained on: recorded at every save, checked at a resume.

A run over many files (`data.path` a directory or a glob) is one data set of their samples in
sorted order, so a file added, renamed or resized moves every later sample: a resume over a
list that differs would continue a different training. The names are relative to the files'
folder, so a moved (or staged) directory is the same data.
"""

from __future__ import annotations

from hpc_rlx.data.files import plan_files
from hpc_rlx.data.fileset import first_difference
from hpc_rlx.base.errors import CheckpointError


_last: list = [None, None]     # (data plan, its record): every save of a run asks for the same


def data_files_record(d) -> dict:
    """{"train": record, "val": record or None} of a spec's data plan (`FileSet.record`)."""
    if _last[0] is not d:
        files, val, _ = plan_files(d)
        _last[:] = [d, {"train": files.record(), "val": None if val is files else val.record()}]
    return _last[1]


def check_data_files(meta: dict, d, where) -> None:
    """CheckpointError naming the first difference between the checkpoint's file list and this
    run's; a checkpoint written before file lists were recorded is not checked."""
    saved = meta.get("data_files")
    if not saved:
        return
    # the training files only: a separate validation set (recorded too) moves no sample of
    # training, and changing it is a choice of what to measure
    diff = first_difference(saved.get("train") or {}, data_files_record(d)["train"], "data.path")
    if diff:
        raise CheckpointError(f"checkpoint {where} was trained on other data files: {diff}; resume "
                              f"over the files it was trained on, or start a new run")
