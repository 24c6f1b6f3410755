"""How much memory a rank may still fill, and whether its data shard fits in it (no MPI).

With `data.cache=memory` a rank reads its whole shard into memory. A shard larger than what
the rank may use is not refused by any allocation: the kernel's OOM killer ends the rank with
signal 9 part-way through the read, and the job dies without a message. So the shard's size is
compared, before anything is read, with the room the rank has:

- the tightest memory limit of the rank's cgroup and its parents (v2 `memory.max`, v1
  `memory.limit_in_bytes`: a batch system's or a container's limit), less what is in use there,
- the node's `MemAvailable`,

the smaller of the two shared among the node's ranks (they all read their shards at once).
In-use memory leaves out the inactive page cache (file pages the kernel drops before it kills
anything), as container runtimes count a working set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
# v1 reports "no limit" as 2**63 - 1 rounded down to a page; anything this large is no limit
_NO_LIMIT = 1 << 60
# what a rank's shard costs beyond its bytes: read buffers, HDF5's chunk cache, a scatter round
MARGIN_FRACTION = 0.10
MARGIN_BYTES = 16 * MIB


@dataclass(frozen=True)
class Room:
    """Bytes a rank may still fill, and where the figure comes from (for the message)."""
    bytes: int
    what: str


def size_text(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


def shard_need(shard_bytes: int) -> int:
    """The memory a shard of `shard_bytes` takes to read and hold, with the margin (pure)."""
    return int(shard_bytes * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


# ---- the cgroup -------------------------------------------------------------------------------

def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None     # v2's "max": no limit


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _hierarchies(proc: Path) -> list[tuple[str, Path, Path]]:
    """("v2" | "v1", the mount point, this process's cgroup directory) of each memory
    hierarchy: /proc/self/cgroup gives the path, /proc/self/mountinfo where it is mounted."""
    try:
        own = [line.split(":", 2) for line in (proc / "self/cgroup").read_text().splitlines()]
        mounts = [line.split() for line in (proc / "self/mountinfo").read_text().splitlines()]
    except OSError:
        return []
    out = []
    for fields in mounts:
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, root, point = fields[sep + 1], fields[3], Path(fields[4])
        supers = fields[sep + 3].split(",") if len(fields) > sep + 3 else []
        if fstype == "cgroup2":
            paths = [p for h, c, p in own if h == "0" and c == ""]
            kind = "v2"
        elif fstype == "cgroup" and "memory" in supers:
            paths = [p for h, c, p in own if "memory" in c.split(",")]
            kind = "v1"
        else:
            continue
        for path in paths:
            # a mount of part of the hierarchy (a container's) shows the path below its root
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            out.append((kind, point, point / rel.lstrip("/")))
    return out


def cgroup_room(proc: Path = Path("/proc")) -> tuple[int, str] | None:
    """(bytes the tightest memory limit above this process still leaves, which limit), or
    None where no limit applies or none can be read."""
    best = None
    for kind, point, here in _hierarchies(proc):
        files = (("memory.max", "memory.current", "memory.stat", "inactive_file") if kind == "v2" else
                 ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file"))
        d = here
        while True:
            limit = _read_int(d / files[0])
            usage = _read_int(d / files[1])
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                used = max(0, usage - _inactive_file(d / files[2], files[3]))
                room = max(0, limit - used)
                if best is None or room < best[0]:
                    best = (room, f"the memory limit of cgroup {d}: {size_text(limit)}, "
                                  f"{size_text(used)} in use")
            if d == point or d.parent == d:
                break
            d = d.parent
    return best


def node_available(proc: Path = Path("/proc")) -> int | None:
    """The node's MemAvailable in bytes, or None where it cannot be read."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rank_room(ranks_on_node: int, host: str, proc: Path = Path("/proc")) -> Room | None:
    """The memory one of the node's `ranks_on_node` ranks may still fill, or None where
    neither a cgroup limit nor the node's available memory can be read."""
    ranks = max(1, int(ranks_on_node))
    found = []
    limited = cgroup_room(proc)
    if limited is not None:
        found.append(limited)
    avail = node_available(proc)
    if avail is not None:
        found.append((avail, f"{host}'s available memory: {size_text(avail)}"))
    if not found:
        return None
    room, what = min(found)
    share = f", shared by its {ranks} ranks on {host}" if ranks > 1 else ""
    return Room(room // ranks, what + share)


def shard_problem(shard_bytes: int, room: Room | None, rows: str, path: str) -> str | None:
    """None where a shard of `shard_bytes` fits the room, else the message (pure)."""
    need = shard_need(shard_bytes)
    if room is None or need <= room.bytes:
        return None
    return (f"this rank's shard of {path} ({rows}) takes {size_text(shard_bytes)} of memory with "
            f"data.cache=memory ({size_text(need)} with read buffers), more than the "
            f"{size_text(room.bytes)} the rank may use "
            f"({room.what}); data.cache=stream trains the same file through a bounded buffer of "
            f"a few tens of MiB a rank (or run fewer ranks a node, on more nodes)")
