"""Run a command under a memory limit: a child cgroup of this process's own, with
`memory.max` (cgroup v2) or `memory.limit_in_bytes` (v1, where v2 has no memory controller),
the command put in it by a small shell wrapper (`echo $$ > cgroup.procs; exec "$@"`), so
mpirun and every rank it starts are inside. Swap is limited too where the files exist, so
a job over the limit is killed, not paged out.

    with MemoryLimit(256 << 20) as limit:            # raises LimitUnavailable with the reason
        subprocess.run(limit.wrap(["mpirun", ...]))
        limit.peak_bytes(), limit.oom_killed()

Used by tests/mpi/data/test_stream.py, tests/mpi/data/test_shard_memory.py and
bench/bench_stream.py. A test takes its limit from `memory_limit_or_skip`: it skips with the
reason where no cgroup can be made, and fails instead under HPC_RLX_REQUIRE_CGROUP=1 (CI).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


class LimitUnavailable(RuntimeError):
    """No writable cgroup with a memory controller here (the message says why)."""


def _mounts() -> list[tuple[str, str, list[str]]]:
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2], parts[3].split(",")))
    return out


def _own_paths() -> dict[str, str]:
    """{'v2': path, 'memory': path} of this process's cgroups."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    return paths


def find_parent() -> tuple[str, Path]:
    """("v2" | "v1", the cgroup under which to make the child), or LimitUnavailable."""
    if os.geteuid() != 0:
        raise LimitUnavailable("not root: cannot create a cgroup")
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        raise LimitUnavailable(f"cannot read the cgroup mounts: {e}") from None
    reasons = []
    for mnt, kind, _ in mounts:
        if kind != "cgroup2":
            continue
        # the child goes under the mount's root: a cgroup with processes of its own cannot
        # hand controllers to children (v2's no-internal-processes rule), the root can
        root = Path(mnt)
        ctl = root / "cgroup.subtree_control"
        try:
            if "memory" not in (root / "cgroup.controllers").read_text().split():
                reasons.append(f"{mnt}: cgroup v2 without the memory controller")
                continue
            if "memory" not in ctl.read_text().split():
                ctl.write_text("+memory")
            return "v2", root
        except OSError as e:
            reasons.append(f"{mnt}: {e}")
    for mnt, kind, opts in mounts:
        if kind == "cgroup" and "memory" in opts:
            base = Path(mnt) / own.get("memory", "/").lstrip("/")
            if os.access(base, os.W_OK):
                return "v1", base
            reasons.append(f"{base}: not writable")
    raise LimitUnavailable("no writable cgroup with a memory controller (" + "; ".join(reasons or ["none mounted"]) + ")")


class MemoryLimit:
    def __init__(self, limit_bytes: int):
        self.limit = int(limit_bytes)
        self.kind, parent = find_parent()
        self.dir = parent / f"hpc_rlx-limit-{uuid.uuid4().hex[:8]}"

    def _files(self) -> dict[str, str]:
        if self.kind == "v2":
            return {"limit": "memory.max", "swap": "memory.swap.max", "peak": "memory.peak",
                    "events": "memory.events"}
        return {"limit": "memory.limit_in_bytes", "swap": "memory.memsw.limit_in_bytes",
                "peak": "memory.max_usage_in_bytes", "events": "memory.oom_control"}

    def __enter__(self) -> "MemoryLimit":
        try:
            self.dir.mkdir()
            f = self._files()
            (self.dir / f["limit"]).write_text(str(self.limit))
            swap = self.dir / f["swap"]
            if swap.exists():      # v1: memory+swap; v2: swap alone
                swap.write_text(str(self.limit if self.kind == "v1" else 0))
        except OSError as e:
            self._remove()
            raise LimitUnavailable(f"cannot set up cgroup {self.dir}: {e}") from None
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd`, run from inside the cgroup (its children, the ranks, stay inside)."""
        procs = self.dir / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh"] + list(cmd)

    def peak_bytes(self) -> int | None:
        try:
            return int((self.dir / self._files()["peak"]).read_text())
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        try:
            text = (self.dir / self._files()["events"]).read_text()
        except OSError:
            return False
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key in ("oom_kill", "oom") and value.strip().isdigit() and int(value) > 0:
                return True
        return False

    def _remove(self) -> None:
        try:
            self.dir.rmdir()
        except OSError:
            pass

    def __exit__(self, *exc) -> None:
        self._remove()


def memory_limit_or_skip(limit_bytes: int) -> MemoryLimit:
    """A `MemoryLimit` for a test; where none can be made, the test skips with the reason, or
    fails under HPC_RLX_REQUIRE_CGROUP=1 (CI, where a skip would hide an untested limit)."""
    import pytest
    try:
        return MemoryLimit(limit_bytes)
    except LimitUnavailable as e:
        if os.environ.get("HPC_RLX_REQUIRE_CGROUP") == "1":
            pytest.fail(f"HPC_RLX_REQUIRE_CGROUP=1 but no memory limit is possible here: {e}", pytrace=False)
        pytest.skip(f"no memory limit possible here: {e}")
