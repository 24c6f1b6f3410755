"""The file side of staging (`data.stage_dir`): the node's directory, its free space, checked
copies, removal. No MPI (`runtime/staging.py` runs it over the ranks); errors are DataErrors
naming the key and the path."""

from __future__ import annotations

import errno
import os
import shutil

from hpc_rlx.base.errors import DataError

__all__ = ["expand_stage_dir", "make_stage_root", "free_bytes", "copy_checked", "remove_stage_root"]

PART = ".part"      # a copy in progress; renamed into place once its size is checked


def expand_stage_dir(value: str) -> str:
    """`data.stage_dir` as this node sees it: `$TMPDIR`, `${SLURM_TMPDIR}` and `~` expanded here,
    since node-local directories differ from node to node (and job to job)."""
    path = os.path.expanduser(os.path.expandvars(str(value)))
    if "$" in path:
        raise DataError(f"data.stage_dir={value}: a variable in it is not set on this node ({path})")
    return os.path.abspath(path)


def make_stage_root(stage_dir: str, name: str) -> str:
    """Create this run's directory `name` inside `stage_dir` (and `stage_dir` if missing): a
    directory that cannot be made is the 'not writable' error."""
    root = os.path.join(stage_dir, name)
    try:
        os.makedirs(stage_dir, exist_ok=True)
        os.mkdir(root)
        probe = os.path.join(root, PART)
        with open(probe, "wb") as f:
            f.write(b"\0")
        os.unlink(probe)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        why = os.strerror(e.errno) if e.errno else str(e)
        raise DataError(f"data.stage_dir={stage_dir} is not writable: cannot create {root} ({why}); "
                        f"point data.stage_dir at a writable node-local directory") from None
    return root


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path`."""
    st = os.statvfs(path)
    return int(st.f_bavail) * int(st.f_frsize)


def copy_checked(src: str, dst: str, size: int) -> None:
    """Copy `src` to `dst` under a temporary name, check the copy holds `size` bytes (the size
    planned with; a source that changed since is an error), then rename it into place: a
    reader never opens a half-made copy."""
    tmp = dst + PART
    try:
        shutil.copyfile(src, tmp)
        got = os.stat(tmp).st_size
        if got != size:
            raise DataError(f"staging {src} to {dst}: the copy holds {got} bytes, the file held "
                            f"{size} when staging was planned (did it change?)")
        os.replace(tmp, dst)
    except OSError as e:
        _unlink(tmp)
        full = " (the staging directory is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise DataError(f"staging {src} to {dst} failed{full}: {e.strerror or e}") from None
    except BaseException:
        _unlink(tmp)
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_stage_root(root: str | None) -> None:
    """Remove a run's staging directory and what is in it; never raises (other ranks of the
    node may be removing it at the same time)."""
    if root:
        shutil.rmtree(root, ignore_errors=True)
