"""A real single-node Slurm cluster for the tests: munged, slurmctld and slurmd on this host.

Everything lives under one state directory (default ``/tmp/hpc_rlx_slurm``, override with
``HPC_RLX_SLURM_ROOT``): its own munge key and socket, a generated ``slurm.conf``, spool, state
and logs. Nothing under ``/etc`` is touched; clients find the cluster through ``SLURM_CONF``,
which :meth:`SlurmCluster.env` sets. Ports are not Slurm's defaults, so a site Slurm on the same
host is left alone.

Starting is idempotent: a cluster already answering on this state directory is reused, and
only daemons this process started are stopped by :meth:`SlurmCluster.stop`.

The settings that work on the sandboxed CI machines (run as root): ``ProctrackType=
proctrack/linuxproc`` (no cgroups), ``TaskPlugin=task/none`` (no affinity calls) and a
partition with ``OverSubscribe=FORCE`` so several small test jobs share the few cores.

Run by hand::

    python tests/support/slurm_cluster.py start    # prints the export line for SLURM_CONF
    python tests/support/slurm_cluster.py stop
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_ROOT = "/tmp/hpc_rlx_slurm"
CTLD_PORT = 16817
SLURMD_PORT = 16818
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


class ClusterUnavailable(RuntimeError):
    """The local Slurm cluster cannot be started here; the message says why."""


def _run(cmd, *, env=None, timeout=20.0, check=False):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=check)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no {path.name})"
    return f"--- last lines of {path} ---\n" + "\n".join(text[-lines:])


def pid_alive(pid_file: Path, name: str) -> int | None:
    """The daemon's pid if it still runs (a pid file left by a killed daemon may name a stranger)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError, IndexError):
        return None
    # "pid (comm) state ...": a killed daemon may linger as a zombie when nothing reaps it
    comm, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:][:1]
    return pid if comm == name[:15] and state not in ("Z", "X") else None


# ---- pieces shared with the multi-node cluster (tests/support/slurm_multinode.py) ----------------------

def binary(name: str) -> str:
    """A Slurm/munge program: on PATH, else in /usr/sbin (daemons are not on a user's PATH)."""
    return shutil.which(name) or str(Path("/usr/sbin", name))


def check_prerequisites() -> None:
    """Raise ClusterUnavailable unless this host can run the Slurm and munge daemons."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        raise ClusterUnavailable("Slurm daemons need a POSIX host")
    if os.geteuid() != 0:
        raise ClusterUnavailable(
            f"the test cluster runs slurmd as root (uid 0); this process is uid {os.geteuid()}")
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None
               and not Path("/usr/sbin", b).exists()]
    if missing:
        raise ClusterUnavailable(
            "Slurm/munge not installed (missing " + ", ".join(missing) +
            "); install with: apt-get install -y slurm-wlm munge")


def wait_ready(ready, timeout: float, what: str, log: Path) -> None:
    """Poll `ready()` until true; raise ClusterUnavailable with the log's tail on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except (subprocess.TimeoutExpired, OSError):
            pass
        time.sleep(0.5)
    raise ClusterUnavailable(f"timed out after {timeout:.0f} s waiting for {what}\n{log_tail(log)}")


def start_munged(munge_dir: Path, socket_path: Path) -> bool:
    """Start munged with a private key and socket under `munge_dir`, unless it already runs.
    Returns whether this call started it."""
    munge_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(munge_dir, 0o700)
    pid_file = munge_dir / "munged.pid"
    if pid_alive(pid_file, "munged") and socket_path.exists():
        return False
    key = munge_dir / "munge.key"
    if not key.exists():
        # a private key: only this cluster's daemons and clients need to agree on it
        key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o600)
    cmd = [binary("munged"), f"--socket={socket_path}", f"--key-file={key}",
           f"--pid-file={pid_file}", f"--log-file={munge_dir / 'munged.log'}",
           f"--seed-file={munge_dir / 'munged.seed'}", "--force"]
    res = _run(cmd, timeout=30)
    if res.returncode != 0:
        raise ClusterUnavailable(f"munged failed to start (exit {res.returncode}): "
                                 f"{res.stderr.strip()}\n{log_tail(munge_dir / 'munged.log')}")
    wait_ready(socket_path.exists, 15, "munged socket", munge_dir / "munged.log")
    return True


def stop_daemon(pid_file: Path, name: str, timeout: float = 15) -> None:
    """SIGTERM the daemon named in `pid_file` until it is gone (or `timeout` passes)."""
    deadline = time.monotonic() + timeout
    pid = pid_alive(pid_file, name)
    while pid and time.monotonic() < deadline:
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        pid = pid_alive(pid_file, name)


def common_conf_lines(*, cluster_name: str, ctld_port: int, slurmd_port: int,
                      munge_socket: Path, state_dir: Path) -> list[str]:
    """The slurm.conf settings of every test cluster: root daemons, a private munge socket,
    no cgroups, prompt scheduling and requeues, jobs visible after they end."""
    # slurmctld starts clean (-c); fresh job ids keep a new job from meeting a killed job's
    # leftovers (MPI shared-memory files are named after the job and step ids)
    first_job_id = 1000 + int(time.time()) % 50_000_000
    return [
        f"ClusterName={cluster_name}",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire also sets how long a requeued job waits before it may start again
        # (default 120 s); the preemption tests requeue jobs
        f"AuthInfo=socket={munge_socket},cred_expire=10",
        f"StateSaveLocation={state_dir}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # no cgroups and no CPU binding inside the sandbox
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        # look at pending jobs every few seconds (default 60 s): requeued jobs restart promptly
        "SchedulerParameters=sched_interval=3,bf_interval=5",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        # finished jobs stay visible to scontrol long enough for the tests to read exit codes
        "MinJobAge=600",
        # time for a rank to write its checkpoint between SIGTERM and SIGKILL
        "KillWait=30",
        "InactiveLimit=0",
        f"FirstJobId={first_job_id}",
        "MessageTimeout=20",
        "SlurmctldTimeout=60",
        "SlurmdTimeout=120",
        "SlurmdParameters=config_overrides",
        "PropagateResourceLimits=NONE",
    ]


class SlurmCluster:
    """One node named after ``hostname -s`` with the CPUs ``nproc`` reports."""

    def __init__(self, root: str | os.PathLike | None = None, *, ctld_port: int = CTLD_PORT,
                 slurmd_port: int = SLURMD_PORT, cluster_name: str = "hpcrlx"):
        self.root = Path(root or os.environ.get("HPC_RLX_SLURM_ROOT") or DEFAULT_ROOT)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.ctld_port = ctld_port
        self.slurmd_port = slurmd_port
        self.cluster_name = cluster_name
        self.partition = "debug"
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self._started: list[str] = []

    # ------------------------------------------------------------------ config
    def slurm_conf_text(self) -> str:
        r = self.root
        return "\n".join(common_conf_lines(
            cluster_name=self.cluster_name, ctld_port=self.ctld_port, slurmd_port=self.slurmd_port,
            munge_socket=self.munge_socket, state_dir=r / "state") + [
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd.log",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE "
            "State=UP OverSubscribe=FORCE",
            "",
        ])

    def env(self, base: dict | None = None) -> dict:
        """Environment for Slurm clients (sbatch, squeue, ...) talking to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        # a submitting shell inside another job must not leak its job into ours
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if key != "SLURM_CONF":
                env.pop(key)
        return env

    # ------------------------------------------------------------------ state
    def _check_prerequisites(self) -> None:
        check_prerequisites()

    def _binary(self, name: str) -> str:
        return binary(name)

    def is_up(self) -> bool:
        """True when slurmctld answers and the node accepts jobs."""
        if not self.conf.exists():
            return False
        try:
            ping = _run(["scontrol", "ping"], env=self.env(), timeout=15)
            if ping.returncode != 0 or "UP" not in ping.stdout:
                return False
            state = self.node_state()
        except (subprocess.TimeoutExpired, OSError):
            return False
        return state.split("+")[0].rstrip("*~#!%$@^-") in {"idle", "mixed", "allocated"}

    def node_state(self) -> str:
        out = _run(["sinfo", "--noheader", "--Node", "--format=%T", f"--nodes={self.node}"],
                   env=self.env(), timeout=15)
        return out.stdout.strip().lower() or "unknown"

    # ------------------------------------------------------------------ start/stop
    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        """Start (or reuse) munged, slurmctld and slurmd; raise ClusterUnavailable with logs."""
        self._check_prerequisites()
        if self.is_up():
            return self
        try:
            for sub in ("state", "spool"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            self.conf.write_text(self.slurm_conf_text())
            self._start_munged()
            self._start_slurm(timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterUnavailable(f"{type(exc).__name__}: {exc}\n{self.logs()}") from exc
        return self

    def _start_munged(self) -> None:
        if start_munged(self.root / "munge", self.munge_socket):
            self._started.append("munged")

    def _start_slurm(self, timeout: float) -> None:
        env = self.env()
        ctld_pid = self.root / "slurmctld.pid"
        if not pid_alive(ctld_pid, "slurmctld"):
            # -c: start clean, jobs of an earlier test run are of no use
            res = _run([self._binary("slurmctld"), "-c", "-f", str(self.conf)], env=env, timeout=30)
            if res.returncode != 0:
                raise ClusterUnavailable(f"slurmctld failed to start (exit {res.returncode}): "
                                         f"{res.stderr.strip()}\n"
                                         f"{log_tail(self.root / 'slurmctld.log')}")
            self._started.append("slurmctld")
        self._wait(lambda: "UP" in _run(["scontrol", "ping"], env=env, timeout=15).stdout,
                   timeout, "slurmctld to answer scontrol ping", self.root / "slurmctld.log")
        if not pid_alive(self.root / "slurmd.pid", "slurmd"):
            res = _run([self._binary("slurmd"), "-f", str(self.conf), "-N", self.node],
                       env=env, timeout=30)
            if res.returncode != 0:
                raise ClusterUnavailable(f"slurmd failed to start (exit {res.returncode}): "
                                         f"{res.stderr.strip()}\n{log_tail(self.root / 'slurmd.log')}")
            self._started.append("slurmd")

        def node_ready() -> bool:
            state = self.node_state()
            if state.startswith(("down", "drain")):
                _run(["scontrol", "update", f"nodename={self.node}", "state=resume"],
                     env=env, timeout=15)
            return self.is_up()

        self._wait(node_ready, timeout, f"node {self.node} to become idle",
                   self.root / "slurmd.log")

    def _wait(self, ready, timeout: float, what: str, log: Path) -> None:
        wait_ready(ready, timeout, what, log)

    def stop(self, *, all_daemons: bool = False) -> None:
        """Stop the daemons this object started (or every one of this state dir)."""
        names = set(DAEMONS if all_daemons else self._started)
        if names & {"slurmctld", "slurmd"} and self.conf.exists():
            try:
                _run(["scontrol", "shutdown"], env=self.env(), timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                pass
        pid_files = {"slurmctld": self.root / "slurmctld.pid", "slurmd": self.root / "slurmd.pid",
                     "munged": self.root / "munge" / "munged.pid"}
        for name in ("slurmd", "slurmctld", "munged"):
            if name in names:
                stop_daemon(pid_files[name], name)
        self._started.clear()

    def logs(self) -> str:
        return "\n".join(log_tail(self.root / f, 30) for f in ("slurmctld.log", "slurmd.log"))


def require_slurm() -> bool:
    """Whether an unavailable cluster is a failure rather than a skip (always on CI)."""
    flag = os.environ.get("HPC_RLX_REQUIRE_SLURM")
    if flag is not None:
        return flag.strip().lower() not in {"", "0", "false", "no"}
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in {"start", "stop", "status"}:
        print("usage: python tests/support/slurm_cluster.py start|stop|status", file=sys.stderr)
        return 2
    cluster = SlurmCluster()
    if argv[0] == "start":
        try:
            cluster.start()
        except ClusterUnavailable as exc:
            print(f"cannot start the local Slurm cluster: {exc}", file=sys.stderr)
            return 1
        print(f"export SLURM_CONF={cluster.conf}")
    elif argv[0] == "stop":
        cluster.stop(all_daemons=True)
    else:
        print("up" if cluster.is_up() else "down")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


class JobPoll:
    """A job's fields, polled until it ends: `ended` is the predicate to wait on, and `last`
    what the last poll saw ({} when the controller did not answer in time)."""

    def __init__(self, fields_of):
        self.fields_of = fields_of
        self.last: dict = {}

    def ended(self) -> bool:
        from hydra_plugins.hpc_rlx_slurm.slurm_jobs import TERMINAL
        self.last = self.fields_of()
        return self.last.get("JobState") in TERMINAL
