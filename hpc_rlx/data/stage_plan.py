"""Staging to node-local storage (`data.stage_dir`): what each node copies, and who copies it.
Pure functions of paths, sizes and sample ranges (no I/O, no MPI; `data/stage_copy.py` copies,
`runtime/staging.py` runs the step over the ranks).

A rank reads the same contiguous block of samples in every epoch (`data/plan.py`: shuffling
permutes samples within the plan's rows, and `data.leftover` only chooses which of a row's
samples sit out), so the files a rank may ever read are those its training block and its
validation slice touch. A node copies the union of its ranks' files once, the copying split
among its ranks by bytes, and each rank reads the node's copies: the same bytes in the same
order, so a staged run trains bitwise like an unstaged one.
"""

from __future__ import annotations

import hashlib
import os

from hpc_rlx.data.fileset import files_of_ranges

__all__ = ["needed_files", "rank_ranges", "assign_copies", "staged_name", "space_problem", "describe_staging",
           "read_places", "human_bytes"]


def needed_files(sets_and_ranges) -> list[str]:
    """The original paths (sorted, each once) a rank reads: `sets_and_ranges` holds
    (FileSet, [(start, stop), ...]) pairs, its training and validation samples."""
    out: set[str] = set()
    for files, ranges in sets_and_ranges:
        if files is None:
            continue
        out.update(files.paths[f] for f in files_of_ranges(files, ranges))
    return sorted(out)


def rank_ranges(rank: int, world: int, train_bounds, val_bounds, scatter: bool) -> tuple[list, list]:
    """(training ranges, validation ranges) rank `rank` reads. With data.distribution=scatter
    rank 0 reads every rank's rows and the others read nothing: only rank 0's node stages."""
    if scatter:
        if rank != 0:
            return [], []
        return list(train_bounds[:world]), list(val_bounds[:world])
    if rank >= world:       # a spare (comm.on_failure=spare) reads nothing until it takes a shard
        return [], []
    return [train_bounds[rank]], [val_bounds[rank]]


def assign_copies(needs: list[list[str]], sizes: dict[str, int]) -> list[list[str]]:
    """Who copies what on one node: `needs[k]`, the files local rank k reads; the union is cut
    so each file is copied once, by the rank with the fewest bytes so far (largest files first,
    ties to the lower rank, so every rank of the node computes the same split)."""
    union = sorted({p for mine in needs for p in mine}, key=lambda p: (-int(sizes[p]), p))
    load = [0] * len(needs)
    out: list[list[str]] = [[] for _ in needs]
    for path in union:
        k = min(range(len(needs)), key=lambda r: (load[r], r))
        out[k].append(path)
        load[k] += int(sizes[path])
    return [sorted(mine) for mine in out]


def staged_name(path: str) -> str:
    """The copy's name in the node's staging directory: the original's name, after a short
    hash of its absolute path, so files of the same name in two folders (data.path and
    data.val_path) do not meet."""
    full = os.path.abspath(path)
    return hashlib.sha256(full.encode("utf-8")).hexdigest()[:10] + "-" + os.path.basename(full)


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def space_problem(stage_dir: str, host: str, need: int, free: int, files: int) -> str | None:
    """The error when a node's copies do not fit its staging directory, else None."""
    if need <= free:
        return None
    return (f"data.stage_dir={stage_dir} on {host} has {human_bytes(free)} free, but this node's "
            f"{files} file(s) to stage take {human_bytes(need)}: point data.stage_dir at a larger "
            f"node-local directory, or leave it unset (null) to read the files in place")


def describe_staging(stage_dir: str, per_node: list[tuple[int, int]], seconds: float) -> str:
    """The start-up line: `per_node` holds (files, bytes) for each node that staged."""
    files = sum(f for f, _ in per_node)
    size = sum(b for _, b in per_node)
    rate = f", {human_bytes(size / seconds)}/s" if seconds > 0 and size else ""
    return (f"staged {files} file(s), {human_bytes(size)}, to data.stage_dir={stage_dir} on "
            f"{len(per_node)} node(s) in {seconds:.2f} s{rate}")



def read_places(sets_and_ranges) -> dict:
    """How many of the files a rank reads (`needed_files`' pairs) it opens from the node's
    copies and how many in place: a staged set's `read_paths` differ from its `paths`. Empty
    when no set is staged (summary.json then says nothing of staging)."""
    staged, in_place = set(), set()
    for files, ranges in sets_and_ranges:
        if files is None:
            continue
        for f in files_of_ranges(files, ranges):
            (in_place if files.opened(f) == files.paths[f] else staged).add(files.paths[f])
    if not any(files is not None and files.read_paths is not None for files, _ in sets_and_ranges):
        return {}
    return {"staged_reads": len(staged), "in_place_reads": len(in_place)}
