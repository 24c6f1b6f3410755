"""Many HDF5 files as one training set: which file holds which sample. Pure math, no I/O.

A :class:`FileSet` is the sorted list of files with their sample counts. Global sample ``i``
lies in file ``f`` at local index ``i - start[f]``: the files together are one file of their
samples in sorted order, so the plan (`data/plan.py`), shuffling and every reader work on
global indices and only the last step, the read, asks the set where a sample lies. One file
is a set of one.

``one_sample``: each file holds one sample without a sample axis (DeepCAM, CosmoFlow); its
count is 1 and its local index always 0.

``read_paths`` is where each file is opened, by default its own path; staging to node-local
disk swaps in the copies (:meth:`FileSet.remapped`) and changes nothing else: the names the
checkpoint records and the order stay those of the originals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["FileSet", "Piece", "first_difference", "rank_pieces", "files_of_ranges"]


@dataclass(frozen=True)
class Piece:
    """Samples [lo, hi) of file `file`, which are samples [at, at + hi - lo) of the range asked."""
    file: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class FileSet:
    paths: tuple            # sorted as Python sorts strings
    counts: tuple           # samples per file
    one_sample: bool = False
    read_paths: tuple | None = None      # where each file is opened (staged copies); None: paths
    starts: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))
        if len(self.paths) != len(self.counts) or not self.paths:
            raise ValueError(f"a file set needs one count per file and at least one file, got "
                             f"{len(self.paths)} paths and {len(self.counts)} counts")
        if self.read_paths is not None and len(self.read_paths) != len(self.paths):
            raise ValueError("read_paths needs one path per file")
        object.__setattr__(self, "starts", np.concatenate(([0], np.cumsum(self.counts, dtype=np.int64))))

    @classmethod
    def single(cls, path, n: int) -> "FileSet":
        return cls((os.fspath(path),), (int(n),))

    @classmethod
    def from_plan(cls, pairs, one_sample: bool = False) -> "FileSet":
        """From the spec's [[path, count], ...]."""
        return cls(tuple(p for p, _ in pairs), tuple(c for _, c in pairs), bool(one_sample))

    def pairs(self) -> list:
        return [[p, c] for p, c in zip(self.paths, self.counts)]

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def n(self) -> int:
        return int(self.starts[-1])

    def opened(self, f: int) -> str:
        """The path file `f` is read from."""
        return self.read_paths[f] if self.read_paths is not None else self.paths[f]

    def named(self, f: int) -> str:
        """File `f` for a message: where it is read, and its original when that differs."""
        read = self.opened(f)
        return read if read == self.paths[f] else f"{read} (a copy of {self.paths[f]})"

    def remapped(self, mapping) -> "FileSet":
        """The same set read from other places: `mapping` original path -> path to open
        (a dict, or a function); files it does not name are read where they are."""
        get = mapping if callable(mapping) else (lambda p: mapping.get(p, p))
        return FileSet(self.paths, self.counts, self.one_sample, tuple(get(p) for p in self.paths))

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample i -> (file, local index)."""
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} is outside the set's {self.n} samples")
        f = int(np.searchsorted(self.starts, i, side="right")) - 1
        return f, int(i - self.starts[f])

    def pieces(self, start: int, stop: int) -> list[Piece]:
        """The contiguous global range [start, stop) as per-file slices, in order."""
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"samples [{start}, {stop}) are outside the set's {self.n} samples")
        out = []
        f = int(np.searchsorted(self.starts, start, side="right")) - 1 if stop > start else 0
        i = start
        while i < stop:
            hi = min(stop, int(self.starts[f + 1]))
            out.append(Piece(f, i - int(self.starts[f]), hi - int(self.starts[f]), i - start))
            i, f = hi, f + 1
        return out

    def split(self, rows: np.ndarray) -> list[tuple[int, np.ndarray, int, int]]:
        """Sorted global rows -> (file, local rows, a, b): rows[a:b] lie in that file."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return []
        if rows[0] < 0 or rows[-1] >= self.n:
            raise IndexError(f"rows outside the set's {self.n} samples")
        files = np.searchsorted(self.starts, rows, side="right") - 1
        cut = np.flatnonzero(np.diff(files)) + 1
        firsts = np.concatenate(([0], cut))
        stops = np.concatenate((cut, [len(rows)]))
        return [(int(files[a]), rows[a:b] - self.starts[files[a]], int(a), int(b))
                for a, b in zip(firsts.tolist(), stops.tolist())]

    def files_in(self, start: int, stop: int) -> range:
        """The files holding samples [start, stop)."""
        if stop <= start:
            return range(0)
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop - 1, side="right")) - 1
        return range(first, last + 1)

    def names(self) -> list[str]:
        """The files' names as the checkpoint records them: relative to the folder they share,
        so a moved (or staged) directory is the same data."""
        if len({os.path.dirname(p) for p in self.paths}) == 1:      # one folder: the common case
            return [os.path.basename(p) for p in self.paths]
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in self.paths])
        return [os.path.relpath(os.path.abspath(p), root) for p in self.paths]

    def record(self) -> dict:
        """What a checkpoint keeps of the set (JSON-able)."""
        return {"names": self.names(), "counts": list(self.counts), "one_sample": self.one_sample}

    def describe(self) -> str:
        """For the start-up line."""
        kind = "one-sample files" if self.one_sample else "files"
        return f"{self.n:,} samples in {len(self):,} {kind}"


def first_difference(saved: dict, now: dict, what: str = "data.path") -> str | None:
    """The first way the recorded file list `saved` differs from `now` (both `record()`s), in
    words, or None when they are the same."""
    if bool(saved.get("one_sample")) != bool(now.get("one_sample")):
        return (f"data.one_sample_per_file was {bool(saved.get('one_sample'))}, now "
                f"{bool(now.get('one_sample'))}")
    a = list(zip(saved.get("names", []), saved.get("counts", [])))
    b = list(zip(now.get("names", []), now.get("counts", [])))
    for k, (old, new) in enumerate(zip(a, b)):
        if old[0] != new[0]:
            return f"{what}'s file {k + 1} was {old[0]!r}, now {new[0]!r}"
        if old[1] != new[1]:
            return f"{what}'s file {old[0]!r} held {old[1]} samples, now {new[1]}"
    if len(b) > len(a):
        return f"{what} has {len(b) - len(a)} more file(s), the first {b[len(a)][0]!r}"
    if len(a) > len(b):
        return f"{what} has {len(a) - len(b)} file(s) fewer, the first missing {a[len(b)][0]!r}"
    return None


def rank_pieces(files: FileSet, start: int, stop: int) -> list[tuple[str, int, int]]:
    """(path, first sample, stop sample) of every file a rank whose rows are [start, stop)
    reads, local to the file. A rank reads the same contiguous block of samples in every epoch
    (`data/plan.py`: shuffling permutes within the plan's rows), so these are the files it
    reads in any epoch; pass `ShardPlan.shard_bounds(rank)` for training and the rank's
    validation range for validation."""
    return [(files.paths[p.file], p.lo, p.hi) for p in files.pieces(start, stop)]


def files_of_ranges(files: FileSet, ranges) -> list[int]:
    """The files (indices, sorted, each once) that any of the ranges [a, b) touches."""
    seen: set[int] = set()
    for a, b in ranges:
        seen.update(files.files_in(int(a), int(b)))
    return sorted(seen)
