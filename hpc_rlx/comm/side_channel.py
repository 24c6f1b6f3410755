"""Where the stall watchdog's side channel listens and how ranks reach it: address choice,
narrow binding, connecting. Sockets only, no MPI (the caller gathers what this needs)."""

from __future__ import annotations

import socket
import sys

__all__ = ["own_addresses", "source_toward", "root_address", "bind_narrowly", "connect_to_root"]


def own_addresses() -> list[str]:
    """The IPv4 addresses this host's name resolves to, loopback left out."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return []
    return sorted({i[4][0] for i in infos if not i[4][0].startswith("127.")})


def source_toward(addr: str) -> str | None:
    """The local address the kernel would send from to reach `addr` (nothing is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((addr, 9))
        return probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()


def root_address(hosts: list, addresses: list, route=source_toward) -> str:
    """Where the other ranks send heartbeats: loopback when the job is on one host, else the
    address rank 0's name resolves to, else (a name that resolves to loopback only, as
    Debian's `127.0.1.1 host` line does) the address rank 0 would use to reach another node,
    which that node can reach back. `addresses[r]` is rank r's own_addresses()."""
    if all(h == hosts[0] for h in hosts):
        return "127.0.0.1"
    if addresses[0]:
        return addresses[0][0]
    for host, addrs in zip(hosts, addresses):
        if host != hosts[0]:
            for addr in addrs:
                src = route(addr)
                if src and not src.startswith("127."):
                    return src
    return socket.gethostname()


def bind_narrowly(sock: socket.socket, addrs) -> tuple[str, int]:
    """Bind rank 0's socket to the first of `addrs` (where the other ranks send: loopback on one
    host) that is this machine's, never to every interface while one of them is. Returns
    (address, port) for the other ranks."""
    addrs = [addrs] if isinstance(addrs, str) else list(dict.fromkeys(addrs))
    for addr in addrs:
        try:
            sock.bind((addr, 0))
            return addr, sock.getsockname()[1]
        except OSError:
            continue
    # none of them is on this machine (its name resolves elsewhere and no other node is
    # routable): the MAC still protects the channel, but say so rather than fail the job
    sys.stderr.write(f"hpc_rlx: warning: stall watchdog could not bind {', '.join(addrs)}; "
                     f"listening on all interfaces (heartbeats stay authenticated)\n")
    sock.bind(("0.0.0.0", 0))
    return addrs[0], sock.getsockname()[1]


def connect_to_root(sock: socket.socket, root: tuple) -> str | None:
    """Fix the socket's peer to rank 0 (the kernel then drops anything else sent to it) and
    return the source address rank 0 will see, so rank 0 can refuse other senders."""
    try:
        sock.connect(root)
        return sock.getsockname()[0]
    except OSError:
        return None
