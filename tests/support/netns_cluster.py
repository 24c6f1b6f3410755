"""An emulated cluster of real hosts on one machine, for the multi-host tests (needs root).

Each node is a set of Linux namespaces held open by one long-lived process:
- its own network namespace, with a veth pair to a bridge that lives in a namespace of its own
  (the host's own network gets no address and no route), an address in 10.77.<n>.0/24 and an
  /etc/hosts naming every node;
- its own UTS namespace (hostname nodeK: `MPI.Get_processor_name()` and the node split see
  different nodes), IPC namespace (or MPICH's UCX would see one host and move every byte through
  shared memory) and mount namespace (a private /dev/shm, the hosts file, and a private scratch
  directory at the same path on every node, to test nodes without a shared filesystem).

`ssh NODE CMD` becomes `nsenter` into NODE's namespaces through a small wrapper script, which
MPICH's hydra takes as `-launcher ssh -launcher-exec WRAPPER` and Open MPI 5 as its
`plm_ssh_agent`. Node k's processes are pinned to core k mod (cores).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SCRATCH = "/tmp/hpc_rlx_node_scratch"     # the same path on every node, a private dir behind it


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=check)


def can_emulate() -> str | None:
    """None if this machine can host the emulated cluster, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network, UTS, IPC and mount namespaces)"
    for tool in ("ip", "unshare", "nsenter", "taskset"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"rlxprobe{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
        _sh("ip", "netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', e)}"
    return None


class EmulatedCluster:
    """`nodes` hosts named node1..nodeN. Use as a context manager; everything it made is torn
    down on exit (namespaces, holder processes, the bridge)."""

    _made_here = 0

    def __init__(self, nodes: int, workdir: Path, net: int = 77, private_self_address: dict | None = None):
        """`private_self_address={'node1': '10.99.0.1'}`: node1 resolves its own name to that
        address (on its loopback, so no other node can reach it), as a misconfigured
        /etc/hosts would; the other nodes still resolve node1 to its real address."""
        self.n = nodes
        self.dir = Path(workdir)
        EmulatedCluster._made_here += 1      # two clusters of one process get distinct names
        self.tag = f"rlx{os.getpid() % 10000}{chr(96 + EmulatedCluster._made_here % 26)}"
        self.subnet = f"10.{net}.{os.getpid() % 200 + 20}"
        self.names = [f"node{k}" for k in range(1, nodes + 1)]
        self.addr = {name: f"{self.subnet}.{k}" for k, name in enumerate(self.names, 1)}
        self.private_self_address = dict(private_self_address or {})
        self.holders: dict[str, subprocess.Popen] = {}
        self.cores = os.cpu_count() or 1
        self.wrapper = self.dir / "ssh-into-node"
        self._made: list[str] = []

    # ---- names --------------------------------------------------------------------------
    def netns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-bridge"

    def veth(self, name: str) -> str:
        return f"{self.tag}{name[4:]}"          # short: interface names are at most 15 bytes

    def scratch(self, name: str) -> Path:
        """The host-side directory behind `SCRATCH` on node `name`."""
        return self.dir / f"scratch-{name}"

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        Path(SCRATCH).mkdir(parents=True, exist_ok=True)
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.addr.items()))
        _sh("ip", "netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        br = ["ip", "netns", "exec", self.bridge_ns]
        _sh(*br, "ip", "link", "add", "br0", "type", "bridge")
        _sh(*br, "ip", "link", "set", "br0", "up")
        for k, name in enumerate(self.names, 1):
            ns, veth = self.netns(name), self.veth(name)
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            _sh("ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name", f"{veth}b",
                "netns", self.bridge_ns)
            _sh(*br, "ip", "link", "set", f"{veth}b", "master", "br0", "up")
            inn = ["ip", "netns", "exec", ns]
            _sh(*inn, "ip", "addr", "add", f"{self.addr[name]}/24", "dev", veth)
            _sh(*inn, "ip", "link", "set", veth, "up")
            _sh(*inn, "ip", "link", "set", "lo", "up")
            node_hosts = hosts
            if name in self.private_self_address:
                own = self.private_self_address[name]
                _sh(*inn, "ip", "addr", "add", f"{own}/32", "dev", "lo")
                node_hosts = self.dir / f"hosts-{name}"
                node_hosts.write_text("127.0.0.1 localhost\n" + "".join(
                    f"{own if n == name else a} {n}\n" for n, a in self.addr.items()))
            scratch = self.scratch(name)
            scratch.mkdir(parents=True, exist_ok=True)
            setup = (f"hostname {name} && mount --bind {node_hosts} /etc/hosts && "
                     f"mount -t tmpfs -o size=1g tmpfs /dev/shm && "
                     f"mount --bind {scratch} {SCRATCH} && echo ready && exec sleep infinity")
            holder = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--uts", "--ipc", "--mount",
                 "--propagation", "private", "sh", "-c", setup],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
            self.holders[name] = holder
            line = holder.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"node {name} did not come up: {holder.stderr.read()[-2000:]}")
        self._write_wrapper()

    def holder_pid(self, name: str) -> int:
        """The pid of the process whose namespaces are node `name` (the `sleep` after exec)."""
        return self.holders[name].pid

    def _write_wrapper(self) -> None:
        cases = "\n".join(
            f"    {name}) pid={self.holder_pid(name)}; core={k % self.cores};;"
            for k, name in enumerate(self.names))
        self.wrapper.write_text(f"""#!/bin/sh
# `ssh [options] NODE COMMAND...` as a command run inside NODE's namespaces.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-l|-p|-i|-F) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
node=$1; shift
case "$node" in
{cases}
    *) echo "ssh-into-node: unknown node $node" >&2; exit 255;;
esac
exec nsenter -t "$pid" -n -u -i -m -- taskset -c "$core" sh -c "$*"
""")
        self.wrapper.chmod(0o755)

    def processes_on(self, name: str) -> list[int]:
        """Every process inside node `name`'s network namespace (the holder included)."""
        try:
            want = os.readlink(f"/proc/{self.holder_pid(name)}/ns/net")
        except OSError:
            return []
        pids = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    if os.readlink(f"/proc/{d}/ns/net") == want:
                        pids.append(int(d))
                except OSError:
                    continue
        return pids

    def kill_everything(self, except_holders: bool = True) -> None:
        """SIGKILL whatever runs on the nodes: launchers' daemons (Open MPI's prted starts a
        session of its own) would otherwise outlive a test and hold its pipes open."""
        holders = {h.pid for h in self.holders.values()}
        for name in list(self.holders):
            for pid in self.processes_on(name):
                if pid != os.getpid() and (pid not in holders or not except_holders):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass

    def close(self) -> None:
        self.kill_everything()
        for holder in self.holders.values():
            try:
                os.killpg(holder.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                holder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.holders.clear()
        for ns in reversed(self._made):
            _sh("ip", "netns", "del", ns, check=False)
        self._made.clear()

    # ---- using the nodes -----------------------------------------------------------------
    def on(self, name: str, cmd: list[str], timeout: float = 60, env: dict | None = None,
           **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on node `name` (inside its namespaces), with a timeout."""
        return subprocess.run(self._enter(name, cmd, kw), capture_output=True, text=True,
                              timeout=timeout, env=env, **kw)

    def popen_on(self, name: str, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self._enter(name, cmd, kw), env=env, **kw)

    def _enter(self, name: str, cmd: list[str], kw: dict) -> list[str]:
        # entering a mount namespace moves to its root: carry the working directory over
        cwd = kw.pop("cwd", None) or os.getcwd()
        return (["nsenter", "-t", str(self.holder_pid(name)), "-n", "-u", "-i", "-m", f"--wd={cwd}", "--"]
                + list(cmd))

    def link(self, name: str, up: bool) -> None:
        """Cut (or restore) node `name`'s network: its interface goes down."""
        _sh("ip", "netns", "exec", self.netns(name), "ip", "link", "set", self.veth(name),
            "up" if up else "down")

    def limit_bandwidth(self, rate: str | None, delay_ms: float = 0) -> None:
        """`tc tbf` on every node's interface (e.g. '1gbit'); with `delay_ms`, `tc netem` at that
        rate and one-way delay instead (a slow wide-area link: '100mbit', 20); None removes the
        limit."""
        for name in self.names:
            inn = ["ip", "netns", "exec", self.netns(name), "tc", "qdisc"]
            _sh(*inn, "del", "dev", self.veth(name), "root", check=False)
            if rate and delay_ms:
                done = _sh(*inn, "add", "dev", self.veth(name), "root", "netem", "delay", f"{delay_ms}ms",
                           "rate", rate, "limit", "100000", check=False)
                if done.returncode:
                    raise RuntimeError(f"tc netem refused ({done.stderr.strip()}): this kernel has no "
                                       f"netem qdisc; shape the rate alone (tbf)")
            elif rate:
                _sh(*inn, "add", "dev", self.veth(name), "root", "tbf", "rate", rate,
                    "burst", "64kb", "latency", "50ms")

    def mpich_cmd(self, mpiexec: str, hosts: dict[str, int], args: list[str]) -> list[str]:
        """`mpiexec` across the nodes: {'node1': 2, 'node2': 2} ranks per node."""
        spec = ",".join(f"{h}:{p}" for h, p in hosts.items())
        n = sum(hosts.values())
        # hydra starts the first host's ranks itself (no ssh): pin it as the wrapper pins the
        # other nodes; without -wdir, ssh-launched ranks start in / (as ssh would in $HOME)
        core = self.names.index(next(iter(hosts))) % self.cores
        return ["taskset", "-c", str(core), mpiexec, "-launcher", "ssh", "-launcher-exec",
                str(self.wrapper), "-hosts", spec, "-wdir", os.getcwd(), "-n", str(n)] + list(args)

    def openmpi_cmd(self, mpirun: str, hosts: dict[str, int], args: list[str]) -> list[str]:
        """Open MPI 5's `mpirun` across the nodes, run on the first node of `hosts`."""
        spec = ",".join(f"{h}:{p}" for h, p in hosts.items())
        n = sum(hosts.values())
        # mpirun forks the ranks of its own node itself (no ssh): pin it as the wrapper pins
        # the other nodes' daemons
        core = self.names.index(next(iter(hosts))) % self.cores
        return ["taskset", "-c", str(core),
                mpirun, "--allow-run-as-root", "--host", spec, "-n", str(n), "--bind-to", "none",
                "--mca", "plm_ssh_agent", str(self.wrapper), "--mca", "mpi_yield_when_idle", "1",
                "--mca", "btl_tcp_if_include", f"{self.subnet}.0/24",
                "--mca", "oob_tcp_if_include", f"{self.subnet}.0/24",
                # PRRTE notices a daemon behind a cut link only by TCP keepalive (default: after
                # 300 s + 9 x 20 s); without this, mpirun outlives an aborted job by minutes
                "--prtemca", "oob_tcp_keepalive_time", "5", "--prtemca", "oob_tcp_keepalive_intvl", "2",
                "--prtemca", "oob_tcp_keepalive_probes", "3"] + list(args)


def wait_for(predicate, timeout: float, every: float = 0.1) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return True
        time.sleep(every)
    return False
