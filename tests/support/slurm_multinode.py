"""A real 2-node Slurm cluster on the emulated hosts of tests/support/netns_cluster.py (needs root).

- one `munged` on the host, its socket under this cluster's own directory: the nodes' mount
  namespaces are copies of the host's, so every node (daemons and clients) reaches it by path;
- `slurmctld` in node1, listening on node1's address;
- one `slurmd -N nodeK` inside each node's namespaces, pinned to that node's core (as the ssh
  wrapper pins MPI ranks), with its own spool directory, pid file and log (`%n` in slurm.conf);
- the host's cgroup mounts remounted inside each node (`ip netns exec` hides /sys/fs/cgroup
  behind a fresh sysfs, and slurmd will not start without it);
- `TmpFS` in the node-private scratch directory: the pmix plugin keeps per-step files there, and
  refuses two steps of a job on different nodes sharing one directory.

Its own ports and config directory; nothing under /etc. Clients (sbatch, srun, scontrol, ...)
run inside node1 through :meth:`MultiNodeSlurm.client`, with `SLURM_CONF` from :meth:`env`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.netns_cluster import SCRATCH, EmulatedCluster
from tests.support.slurm_cluster import (ClusterUnavailable, binary, check_prerequisites, common_conf_lines,
                            log_tail, pid_alive, start_munged, stop_daemon, wait_ready)

CTLD_PORT = 26817
SLURMD_PORT = 26818
CGROUP_ROOT = "/sys/fs/cgroup"
NODE_TMP = f"{SCRATCH}/slurm-tmp"        # TmpFS: the same path on every node, private to each


def cgroup_mounts(mounts_text: str) -> list[tuple[str, str, str]]:
    """(fstype, mount point, options) of the cgroup mounts in a /proc/self/mounts text, the
    /sys/fs/cgroup root first."""
    found = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and (fields[1] == CGROUP_ROOT or fields[1].startswith(CGROUP_ROOT + "/")):
            found.append((fields[2], fields[1], fields[3]))
    return sorted(found, key=lambda m: m[1] != CGROUP_ROOT)


def remount_script(mounts: list[tuple[str, str, str]]) -> str:
    """Shell commands that mount `mounts` again, in a mount namespace where they are hidden.
    Remounting a cgroup v1 hierarchy with the same controllers attaches the existing one."""
    steps = []
    for fstype, target, options in mounts:
        steps.append(f"mkdir -p {target} && mount -t {fstype} -o {options} {fstype} {target}")
    return " && ".join(steps) or "true"


class MultiNodeSlurm:
    """slurmctld + one slurmd per node of `nodes`, partition `debug` over all of them.
    Use as a context manager (or start/stop); stop ends every daemon this object started."""

    def __init__(self, nodes: EmulatedCluster, root: Path, *, ctld_port: int = CTLD_PORT,
                 slurmd_port: int = SLURMD_PORT, cluster_name: str = "hpcrlxmn"):
        self.nodes = nodes
        self.root = Path(root)
        self.ctld_port, self.slurmd_port = ctld_port, slurmd_port
        self.cluster_name = cluster_name
        self.partition = "debug"
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self.head = nodes.names[0]
        self._started: list[tuple[str, Path]] = []      # (daemon name, pid file)

    # ---- paths ---------------------------------------------------------------------------
    def slurmd_pid_file(self, node: str) -> Path:
        return self.root / f"slurmd-{node}.pid"

    def slurmd_log(self, node: str) -> Path:
        return self.root / f"slurmd-{node}.log"

    def slurm_conf_text(self) -> str:
        r, names = self.root, self.nodes.names
        return "\n".join(common_conf_lines(
            cluster_name=self.cluster_name, ctld_port=self.ctld_port, slurmd_port=self.slurmd_port,
            munge_socket=self.munge_socket, state_dir=r / "state") + [
            f"SlurmctldHost={self.head}({self.nodes.addr[self.head]})",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            # %n: the node name slurmd runs as (slurmd -N), one spool, pid file and log each
            f"SlurmdSpoolDir={r}/spool-%n",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            f"TmpFS={NODE_TMP}",
            # one core per node: each node's slurmd (and so its tasks) is pinned to one core
            *(f"NodeName={n} NodeAddr={self.nodes.addr[n]} CPUs=1 Sockets=1 CoresPerSocket=1 "
              "ThreadsPerCore=1 State=UNKNOWN" for n in names),
            f"PartitionName={self.partition} Nodes={','.join(names)} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=FORCE",
            "",
        ])

    def env(self, base: dict | None = None) -> dict:
        """Environment for clients of this cluster: SLURM_CONF, and no enclosing job's SLURM_*."""
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            env.pop(key)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def client(self, cmd: list, *, env: dict | None = None, cwd=None,
               timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client inside node1 (only the nodes reach slurmctld), with a timeout."""
        return self.nodes.on(self.head, [str(c) for c in cmd], env=self.env(env), cwd=cwd,
                             timeout=timeout)

    # ---- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "MultiNodeSlurm":
        self.start()
        return self

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False

    def start(self, timeout: float = 45) -> "MultiNodeSlurm":
        """munged, slurmctld and the slurmds; raise ClusterUnavailable (with logs) if any fails."""
        check_prerequisites()
        try:
            self._start(timeout)
        except (OSError, subprocess.TimeoutExpired, ClusterUnavailable) as exc:
            self.stop()
            if isinstance(exc, ClusterUnavailable):
                raise
            raise ClusterUnavailable(f"{type(exc).__name__}: {exc}\n{self.logs()}") from exc
        return self

    def _start(self, timeout: float) -> None:
        (self.root / "state").mkdir(parents=True, exist_ok=True)
        for node in self.nodes.names:
            # slurmd does not create its spool directory
            (self.root / f"spool-{node}").mkdir(exist_ok=True)
            (self.nodes.scratch(node) / "slurm-tmp").mkdir(exist_ok=True)
        self.conf.write_text(self.slurm_conf_text())
        if start_munged(self.munge_dir, self.munge_socket):
            self._started.append(("munged", self.munge_dir / "munged.pid"))
        self._remount_cgroups()
        self._daemon(self.head, ["slurmctld", "-c", "-f", str(self.conf)], "slurmctld",
                     self.root / "slurmctld.pid", self.root / "slurmctld.log")
        wait_ready(lambda: "UP" in self.client(["scontrol", "ping"], timeout=15).stdout, timeout,
                   "slurmctld to answer scontrol ping", self.root / "slurmctld.log")
        for k, node in enumerate(self.nodes.names):
            core = str(k % self.nodes.cores)
            self._daemon(node, ["taskset", "-c", core, binary("slurmd"), "-f", str(self.conf),
                                "-N", node], "slurmd", self.slurmd_pid_file(node), self.slurmd_log(node))
        wait_ready(self.all_idle, timeout, "every node to become idle", self.root / "slurmctld.log")

    def _remount_cgroups(self) -> None:
        script = remount_script(cgroup_mounts(Path("/proc/self/mounts").read_text()))
        for node in self.nodes.names:
            res = self.nodes.on(node, ["sh", "-c", script], timeout=30)
            if res.returncode != 0:
                raise ClusterUnavailable(f"cannot mount the cgroup hierarchies on {node}: "
                                         f"{res.stderr.strip()}")

    def _daemon(self, node: str, cmd: list[str], name: str, pid_file: Path, log: Path) -> None:
        if cmd[0] == name:
            cmd = [binary(name)] + cmd[1:]
        # the daemon forks into the background inside the node's namespaces, then this returns
        res = self.nodes.on(node, cmd, env=self.env(), timeout=30)
        if res.returncode != 0:
            raise ClusterUnavailable(f"{name} on {node} failed to start (exit {res.returncode}): "
                                     f"{res.stderr.strip()}\n{log_tail(log)}")
        self._started.append((name, pid_file))
        wait_ready(lambda: pid_alive(pid_file, name), 15, f"{name} on {node} to write its pid",
                   log)

    def node_states(self) -> dict[str, str]:
        out = self.client(["sinfo", "--noheader", "--Node", "--format=%N %T"], timeout=15).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def all_idle(self) -> bool:
        states = self.node_states()
        for node, state in states.items():
            if state.startswith(("down", "drain")):
                self.client(["scontrol", "update", f"nodename={node}", "state=resume"], timeout=15)
        return sorted(states) == sorted(self.nodes.names) and all(
            s.rstrip("*~#!%$@^-") in {"idle", "mixed", "allocated"} for s in states.values())

    def stop(self) -> None:
        """End what this object started: slurmds, then slurmctld, then munged."""
        if any(name != "munged" for name, _ in self._started) and self.nodes.holders:
            try:
                self.client(["scontrol", "shutdown"], timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass
        order = {"slurmd": 0, "slurmctld": 1, "munged": 2}
        for name, pid_file in sorted(self._started, key=lambda d: order[d[0]]):
            stop_daemon(pid_file, name)
        self._started.clear()

    def logs(self) -> str:
        files = [self.root / "slurmctld.log"] + [self.slurmd_log(n) for n in self.nodes.names]
        return "\n".join(log_tail(f, 30) for f in files)
