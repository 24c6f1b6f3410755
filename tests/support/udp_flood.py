"""A hostile neighbour for the stall watchdog's tests: find every UDP port a job's processes hold,
capture its genuine heartbeats off the loopback interface, and send forged, replayed, foreign
and malformed datagrams to those ports for a bounded time. Needs root (a packet socket)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import threading
import time
from collections import Counter

FORGED_LABEL = "FORGED-by-a-stranger"


def _descendants(root: int) -> set[int]:
    """`root` and every process below it (launchers may put each rank in a session of its own,
    as MPICH's proxy does, so sessions and process groups do not find them all)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _socket_inodes(pids: set[int]) -> set[int]:
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
        except OSError:
            continue
    return inodes


def udp_sockets(root: int, listening: bool = False) -> set[tuple[str, int]]:
    """(local address, port) of the IPv4 UDP sockets held by process `root` and its descendants,
    each read in its own network namespace (/proc/PID/net/udp). `listening`: only the sockets
    that take datagrams from anyone (bound, not connected to one peer)."""
    found = set()
    for pid in _descendants(root):
        inodes = _socket_inodes({pid})
        if not inodes:
            continue
        try:
            with open(f"/proc/{pid}/net/udp") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[9]) in inodes and not (listening and cols[2] != "00000000:0000"):
                        hexaddr, hexport = cols[1].split(":")
                        addr = socket.inet_ntoa(struct.pack("<I", int(hexaddr, 16)))
                        found.add((addr, int(hexport, 16)))
        except OSError:
            continue
    return found


def udp_ports(root: int) -> set[int]:
    """Local ports of the IPv4 UDP sockets held by process `root` and its descendants."""
    return {port for _, port in udp_sockets(root)}


def forged_datagrams(ranks: int, rng: random.Random):
    """(kind, bytes) a stranger without the job's key can make: forged heartbeats for every
    rank, malformed and oversized datagrams."""
    for r in range(ranks):
        forged = {"r": r, "label": FORGED_LABEL, "step": 1, "for": 1e6, "seq": 1, "last": None}
        yield "forged_plain_json", json.dumps(forged).encode()
        body = json.dumps(forged).encode()
        header = b"\xb7\x01" + struct.pack(">IQ", r, rng.randrange(1, 2 ** 62))
        yield "forged_sealed", header + body + rng.randbytes(32)
    yield "malformed", b""
    yield "malformed", rng.randbytes(rng.randrange(1, 200))
    yield "malformed", b"\xb7\x01" + struct.pack(">IQ", 2 ** 31, 1) + b"{}" + bytes(32)
    yield "oversized", rng.randbytes(4000)


class Flood:
    """Floods every UDP port of the job under launcher process `root` on 127.0.0.1 from a
    thread, for at most `seconds` once the ports are found; `sent` counts what it sent."""

    def __init__(self, root: int, ranks: int, seconds: float = 4.0, find_timeout: float = 60.0):
        self.root, self.ranks, self.seconds, self.find_timeout = root, ranks, seconds, find_timeout
        self.sent: Counter = Counter()
        self.ports: set[int] = set()
        self.captured: list[bytes] = []
        self._stop = threading.Event()
        self._sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
        self._sniffer.bind(("lo", 0))
        self._sniffer.settimeout(0.05)
        self._plain = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._plain.bind(("127.0.0.1", 0))
        self._foreign = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._foreign.bind(("127.0.0.2", 0))        # another address: not a rank's
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    @property
    def flooding(self) -> bool:
        """Still sending: found the ports and neither stopped nor past its time."""
        return bool(self.ports) and self._thread.is_alive() and not self._stop.is_set()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)
        self._sniffer.close()
        return False

    def _find_ports(self) -> None:
        """Wait for a port that listens (rank 0's): the ranks' sockets, connected to rank 0,
        may show up in the same scan and take nothing from us."""
        t0 = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - t0 < self.find_timeout:
            listening = {port for _, port in udp_sockets(self.root, listening=True)}
            if listening:
                self.ports = listening | udp_ports(self.root)
                return
            time.sleep(0.05)

    def _capture(self) -> None:
        """Genuine datagrams to the job's ports, as they pass over loopback (ours left out)."""
        ours = {self._plain.getsockname()[1], self._foreign.getsockname()[1]}
        while not self._stop.is_set():
            try:
                packet = self._sniffer.recv(65535)
            except (socket.timeout, OSError):
                continue
            ihl = (packet[0] & 0x0F) * 4
            if packet[9] != 17 or len(packet) < ihl + 8:     # UDP only
                continue
            sport, dport = struct.unpack_from(">HH", packet, ihl)
            payload = packet[ihl + 8:]
            if (dport in self.ports and sport not in ours and payload
                    and payload not in self.captured[-16:]):
                self.captured.append(payload)

    def _datagrams(self, rng: random.Random):
        yield from forged_datagrams(self.ranks, rng)
        for d in self.captured[-8:]:
            yield "replay", d

    def _run(self) -> None:
        self._find_ports()
        if not self.ports:
            return
        capture = threading.Thread(target=self._capture, daemon=True)
        capture.start()
        rng = random.Random(0)
        end = time.monotonic() + self.seconds
        try:
            while time.monotonic() < end and not self._stop.is_set():
                for port in sorted(self.ports):
                    for kind, data in self._datagrams(rng):
                        try:
                            self._plain.sendto(data, ("127.0.0.1", port))
                            self.sent[kind] += 1
                        except OSError:
                            pass
                    for data in self.captured[-4:]:
                        try:
                            self._foreign.sendto(data, ("127.0.0.1", port))
                            self.sent["foreign"] += 1
                        except OSError:
                            pass
                time.sleep(0.002)
        finally:
            self._stop.set()
            capture.join(timeout=5)
            self._plain.close()
            self._foreign.close()


def capture(port: int, seconds: float) -> list[bytes]:
    """Datagrams to `port` seen on any interface of this network namespace for `seconds`."""
    sniffer = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(0x0800))
    sniffer.settimeout(0.05)
    got: list[bytes] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            try:
                packet = sniffer.recv(65535)
            except socket.timeout:
                continue
            ihl = (packet[0] & 0x0F) * 4
            if packet[9] == 17 and len(packet) >= ihl + 8:
                if struct.unpack_from(">H", packet, ihl + 2)[0] == port and packet[ihl + 8:] not in got:
                    got.append(packet[ihl + 8:])
    finally:
        sniffer.close()
    return got


def main() -> None:
    """Run inside a host of the emulated cluster:

    python -m tests.support.udp_flood capture PORT SECONDS OUT    # genuine datagrams to PORT -> OUT (hex lines)
    python -m tests.support.udp_flood flood ADDR PORT[,PORT] RANKS SECONDS [REPLAY_FILE]

    `flood` sends what a stranger can make (and the datagrams of REPLAY_FILE, again and again)
    to those ports for SECONDS or until SIGTERM, then prints what it sent (JSON)."""
    import sys

    if sys.argv[1] == "capture":
        port, seconds, out = int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
        with open(out, "w") as f:
            f.writelines(d.hex() + "\n" for d in capture(port, seconds))
        return
    addr, ports, ranks, seconds = sys.argv[2], [int(p) for p in sys.argv[3].split(",")], int(sys.argv[4]), float(sys.argv[5])
    replays = []
    if len(sys.argv) > 6:
        with open(sys.argv[6]) as f:
            replays = [bytes.fromhex(line.strip()) for line in f if line.strip()]
    rng, sent = random.Random(0), Counter()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    end = time.monotonic() + seconds
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))     # the test is done: report
    while time.monotonic() < end and not stop:
        for port in ports:
            batch = list(forged_datagrams(ranks, rng)) + [("replay", d) for d in replays[-8:]]
            for kind, data in batch:
                try:
                    sock.sendto(data, (addr, port))
                    sent[kind] += 1
                except OSError:
                    pass
        time.sleep(0.002)
    print(json.dumps(sent))


if __name__ == "__main__":
    main()
