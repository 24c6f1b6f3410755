"""Stall watchdog: say which step and which ranks a blocked collective is waiting for.

A collective that never completes blocks the calling thread inside MPI, so the report has to
travel outside MPI. Each rank runs one daemon thread:

- every rank's thread sends a tiny UDP datagram to rank 0 every `poll_s` (a quarter of
  `comm.stall_warning_s`, at most 5 s): "in collective X since N s at step S" or "busy
  outside any collective, last at step S". The training loop only sets one tuple attribute on
  entering and leaving a collective, so a step costs no extra message and no extra collective.
- rank 0's thread keeps the latest state of every rank. When some rank has waited in a
  collective for `stall_warning_s`, it prints one report: the collective, the step, the ranks
  that arrived, and for every rank that has not, what it was last doing (or that it has gone
  silent). After `comm.stall_abort_s` it prints the report again and aborts the MPI job.
- if rank 0 itself cannot act (stuck holding the interpreter, or its watchdog is unreachable),
  a waiting rank aborts the job on its own a little later, with what it knows locally.

UDP goes to rank 0's host; ranks on rank 0's node use loopback. Where the cluster network
drops UDP between nodes, reports lose the remote ranks' detail, and the local abort still
fires. Collectives outside `hpc_rlx.comm.collective`'s guarded helpers are not watched.

Anyone who can reach rank 0's port can send to it, so every datagram is sealed with a per-job
key and checked before rank 0 acts on it (`hpc_rlx.comm.heartbeat`); rejected datagrams are only
counted, and nothing that arrives can stop the thread or reach the training loop.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Callable

from hpc_rlx.comm.heartbeat import (
    DROP_REASONS,
    MAX_DATAGRAM,
    HeartbeatGate,
    HeartbeatSealer,
    JobSecret,
)
from hpc_rlx.comm.job_abort import abort_job
from hpc_rlx.comm.side_channel import bind_narrowly, connect_to_root, own_addresses, root_address
from hpc_rlx.comm.stall_report import alive_and_busy, at_step, describe_state, stall_report
from hpc_rlx.base.topology import hostname, rank_span

__all__ = ["StallWatchdog", "NullWatchdog", "current", "install", "describe_state", "stall_report"]  # the last two re-exported from stall_report

_REPORT_EVERY_S = 10.0         # at most one stall report per this many seconds
_RECV_BUFFER = 256 * 1024      # the kernel's queue for rank 0's socket: a flood overflows it, not us
_WINDOW_S = 0.1                # rank 0 handles at most a budget of datagrams per window
# comm.stall_abort_s=auto: PyTorch's collective timeout, and only for a job that is stuck
DEFAULT_ABORT_S = 600.0



class NullWatchdog:
    """What the guarded collectives talk to when no watchdog runs: does nothing."""

    def enter(self, label: str) -> None:
        pass

    def leave(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> None:
        return None


_NULL = NullWatchdog()
_current: "StallWatchdog | NullWatchdog" = _NULL


def current():
    """The active watchdog of this process, or a no-op one."""
    return _current


def install(wd) -> None:
    global _current
    _current = wd if wd is not None else _NULL


# --------------------------------------------------------------------------------------
# The watchdog
# --------------------------------------------------------------------------------------

class StallWatchdog:
    """Per-rank watchdog thread with a UDP side channel to rank 0. Collective to create."""

    def __init__(self, comm, warn_s: float, abort_s: float | str | None = None,
                 position: Callable[[], int | None] = lambda: None,
                 out=None, stall=None, abort: Callable[[int], None] | None = None):

        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.warn_s = float(warn_s)
        # `auto`: abort only a job that is stuck (no rank alive and busy outside a collective);
        # a number: abort whenever a collective has waited that long, whatever the others do
        self.abort_only_when_stuck = abort_s == "auto"
        self.abort_s = (DEFAULT_ABORT_S if abort_s == "auto" else
                        None if abort_s is None else float(abort_s))
        self.poll_s = min(5.0, max(0.05, self.warn_s / 4))
        # a rank is "silent" after missing a few heartbeats
        self.silent_after = max(3 * self.poll_s, 1.0)
        # no answer from rank 0 (or no heartbeat at rank 0) this long after the start: unreachable
        self.reach_after = max(5.0, 8 * self.poll_s)
        self._started = time.monotonic()
        self._last_ack = None      # non-root: when rank 0 last answered a heartbeat
        self._reach_warned = False
        self.position = position
        self.out = out or sys.stderr
        self._abort = abort or self._mpi_abort
        self._stall = stall        # debug.stall_*: arrive late once (None: never)
        # (label, step, since, seq) while inside a collective; None outside
        self._inside = None
        self._last = None          # (label, step) of the last collective left
        self._left_at = time.monotonic()
        self._seq = 0              # collectives entered: tells apart two visits at one step
        self._stop = threading.Event()
        self._aborting = False
        self.reports: list[str] = []

        host = hostname()
        hosts, addresses = zip(*comm.allgather((host, own_addresses())))
        self.hosts = dict(enumerate(hosts))
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        offer = None
        if self.rank == 0:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECV_BUFFER)
            # the address rank 0's name resolves to; if that is not this machine's (a stale
            # hosts entry), the one it reaches another node from
            addr = bind_narrowly(self._sock, [root_address(list(hosts), list(addresses)),
                                              root_address(list(hosts), [[]] + list(addresses[1:]))])
            # the key and nonce travel over MPI only: whoever can reach the port cannot learn them
            offer = (addr, JobSecret.draw().as_tuple())
        addr, (key, nonce) = comm.bcast(offer, root=0)
        self._root = tuple(addr)
        secret = JobSecret(key, nonce)
        source = None
        self._sealer = HeartbeatSealer(secret, self.rank)
        if self.rank != 0:
            source = connect_to_root(self._sock, self._root)
            # rank 0's answers: only from rank 0's address (the connected socket sees no other)
            self._gate = HeartbeatGate(secret, 1, {0: self._root[0]}, answers=True)
            self._sock.setblocking(False)
        sources = comm.gather(source, root=0)
        if self.rank == 0:
            self._gate = HeartbeatGate(secret, self.size, dict(enumerate(sources or [])), own_rank=0)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._states: dict[int, dict] = {}
        self._reported: set = set()
        self._last_report = -float("inf")
        # a flood must not starve training of the interpreter: bounded datagrams per window
        self._budget = max(200, int(20 * self.size * _WINDOW_S / self.poll_s))
        self._thread = threading.Thread(target=self._loop, name="hpc_rlx-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def from_spec(cls, spec, comm, position, stall=None):
        """The watchdog `comm.stall_*` asks for; `stall`: this rank's debug.stall_* plan
        (`injection.StallPlan`: `step`, `seconds`), or None."""
        c = spec.comm
        warn = c["stall_warning_s"]
        if warn is None or float(warn) <= 0 or comm.size == 1:   # one rank waits for nobody
            return NullWatchdog()
        return cls(comm, float(warn), c["stall_abort_s"], position=position, stall=stall)

    # ---- the hot path: two attribute writes per collective ------------------------------
    def enter(self, label: str) -> None:
        step = self.position()
        if self._stall:
            self._maybe_stall(step)
        self._seq += 1
        self._inside = (label, step, time.monotonic(), self._seq)

    def leave(self) -> None:
        inside = self._inside
        self._inside = None
        if inside is not None:
            self._last = (inside[0], inside[1])
        self._left_at = time.monotonic()

    def _maybe_stall(self, step) -> None:
        """debug.stall_*: this rank arrives late, once, at the first watched collective from
        `stall.step` on, so tests can watch the watchdog catch it."""
        stall = self._stall
        if step is not None and step >= stall.step:
            self._stall = None
            time.sleep(stall.seconds)

    # ---- the side channel -----------------------------------------------------------------
    def _heartbeat(self) -> dict:
        now = time.monotonic()
        inside = self._inside
        if inside is not None:
            return {"r": self.rank, "label": inside[0], "step": inside[1], "for": now - inside[2],
                    "seq": inside[3], "last": self._last}
        try:
            at = self.position()
        except Exception:  # noqa: BLE001 - the loop may be between states
            at = None
        return {"r": self.rank, "label": None, "step": None, "at": at, "for": now - self._left_at,
                "seq": self._seq, "last": self._last}

    def _send(self, msg: dict) -> None:
        try:
            self._sock.sendto(self._sealer.seal(msg), self._root)
        except Exception:  # noqa: BLE001 - a dropped heartbeat only makes this rank look silent
            pass

    def _loop(self) -> None:
        try:
            if self.rank == 0:
                self._root_loop()
            else:
                self._send(self._heartbeat())           # at once: rank 0 learns early who it hears
                while not self._stop.wait(self.poll_s):
                    self._send(self._heartbeat())
                    self._hear_rank_0()
                    self._local_check()
        except Exception as exc:  # noqa: BLE001 - the watchdog must never take training down
            try:
                self.out.write(f"hpc_rlx: warning: stall watchdog on rank {self.rank} stopped: {exc}\n")
            except Exception:  # noqa: BLE001
                pass

    def _root_loop(self) -> None:
        self._sock.settimeout(min(self.poll_s, 0.5))     # so close() is never kept waiting
        next_check = time.monotonic()
        window_end, handled = time.monotonic() + _WINDOW_S, 0
        while not self._stop.is_set():
            self._receive_one()
            now = time.monotonic()
            handled += 1
            if now >= window_end:
                window_end, handled = now + _WINDOW_S, 0
            elif handled >= self._budget:
                # over budget (a flood): let the kernel queue overflow instead of this thread
                self._stop.wait(window_end - now)
                now = time.monotonic()
                window_end, handled = now + _WINDOW_S, 0
            if now >= next_check:
                next_check = now + self.poll_s
                try:
                    mine = self._heartbeat()
                    mine["recv"] = now
                    self._states[0] = mine
                    self._check(now)
                except Exception:  # noqa: BLE001 - a bad state must not end stall detection
                    pass

    def _receive_one(self) -> None:
        """Take one datagram off the socket; act on it only if the gate admits it."""
        try:
            data, sender = self._sock.recvfrom(MAX_DATAGRAM + 1)
        except (socket.timeout, BlockingIOError, InterruptedError):
            return
        except OSError:
            if not self._stop.is_set():
                time.sleep(0.01)
            return
        try:
            msg, reason = self._gate.admit(data, sender[0] if sender else None)
            if msg is None:
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
                return
            msg["recv"] = time.monotonic()
            self._states[msg["r"]] = msg
            if "bye" not in msg:
                # "I hear you": lets the rank tell a one-way channel from a quiet one
                self._sock.sendto(self._sealer.seal({"r": 0, "ack": msg["seq"]}), sender)
        except Exception:  # noqa: BLE001 - nothing that arrives may stop the watchdog
            self.dropped["malformed"] += 1

    def _hear_rank_0(self) -> None:
        """Non-root: take rank 0's answers off the socket; warn once if none ever comes."""
        for _ in range(64):
            try:
                data, sender = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError, OSError):
                break
            try:
                msg, _ = self._gate.admit(data, sender[0] if sender else None)
            except Exception:  # noqa: BLE001
                msg = None
            if msg is not None and "ack" in msg:
                self._last_ack = time.monotonic()
        now = time.monotonic()
        if self._last_ack is None and not self._reach_warned and now - self._started > self.reach_after:
            self._reach_warned = True
            self._emit(f"hpc_rlx: warning: rank {self.rank} on {self.hosts.get(self.rank)}: rank 0's "
                       f"stall watchdog at {self._root[0]}:{self._root[1]} has not answered in "
                       f"{now - self._started:.0f} s: its heartbeats cannot reach rank 0 (UDP blocked "
                       f"between the nodes, or rank 0's hostname resolves to an address this node "
                       f"cannot reach); stall reports will lack this rank's state")

    def _say_if_never_heard(self) -> None:
        """At the end of a run shorter than `reach_after`: still say it once, if a few
        heartbeats went unanswered (rank) or never arrived (rank 0)."""
        if self._reach_warned or time.monotonic() - self._started < 3 * self.poll_s:
            return
        if self.rank != 0 and self._last_ack is None and self._sealer.counter >= 3:
            self.reach_after = 0.0
            self._hear_rank_0()
        elif self.rank == 0:
            self._warn_unheard(time.monotonic())

    def _rank_0_unheard(self) -> bool:
        now = time.monotonic()
        last = self._last_ack if self._last_ack is not None else self._started
        return now - last > self.silent_after

    def _check(self, now: float) -> None:
        if not self._reach_warned and now - self._started > self.reach_after:
            self._warn_unheard(now)
        found = stall_report(self._states, self.size, now, self.warn_s, self.silent_after, self.hosts,
                             self._root)
        if found is None:
            return
        text, key = found
        waited = max(st["for"] + now - st["recv"] for st in self._states.values()
                     if st.get("label") is not None and not st.get("bye")
                     and now - st["recv"] <= self.silent_after)
        if key not in self._reported and now - self._last_report >= _REPORT_EVERY_S:
            self._reported.add(key)
            self._last_report = now
            self._emit(text + ("" if self.abort_s is None else
                               f"\nhpc_rlx:   the job aborts if it is still stalled after "
                               f"comm.stall_abort_s={self.abort_s:g} s"))
        if self.abort_s is None or waited < self.abort_s or self._aborting:
            return
        busy = alive_and_busy(self._states, now, self.silent_after)
        if self.abort_only_when_stuck and busy:
            return      # the default never ends a job whose ranks are alive and working
        setting = f"auto ({self.abort_s:g} s)" if self.abort_only_when_stuck else f"{self.abort_s:g}"
        self._do_abort(text + f"\nhpc_rlx: stalled for {waited:.1f} s >= comm.stall_abort_s="
                              f"{setting}: aborting all {self.size} ranks")

    def _warn_unheard(self, now: float) -> None:
        """Rank 0, once: ranks none of whose heartbeats have arrived since the start."""
        self._reach_warned = True
        unheard = [r for r in range(1, self.size) if r not in self._states]
        if unheard:
            hosts = sorted({self.hosts.get(r, "?") for r in unheard})
            self._emit(f"hpc_rlx: warning: no heartbeat from rank(s) {rank_span(unheard)} on "
                       f"{', '.join(hosts)} has reached rank 0's stall watchdog at "
                       f"{self._root[0]}:{self._root[1]} in {now - self._started:.0f} s (UDP blocked "
                       f"between the nodes, or {self._root[0]} is not reachable from there); stall "
                       f"reports will lack their state")

    def _local_check(self) -> None:
        """Fallback for when rank 0 cannot act: abort from here, a few heartbeats later."""
        inside = self._inside
        if self.abort_s is None or inside is None or self._aborting:
            return
        if self.abort_only_when_stuck and not self._rank_0_unheard():
            return      # rank 0 answers, so it sees the whole job and decides
        waited = time.monotonic() - inside[2]
        if waited >= self.abort_s + 4 * self.poll_s + 2.0:
            self._do_abort(
                f"hpc_rlx: STALL: rank {self.rank} on {self.hosts.get(self.rank)} has waited "
                f"{waited:.1f} s in '{inside[0]}' {at_step(inside[1])} and rank 0's watchdog has "
                f"not ended the job (rank 0 may be stuck or unreachable)\n"
                f"hpc_rlx: comm.stall_abort_s={self.abort_s:g}: aborting all {self.size} ranks")

    def _emit(self, text: str) -> None:
        self.reports.append(text)
        self.out.write(text.rstrip() + "\n")
        self.out.flush()

    def _do_abort(self, text: str) -> None:
        self._aborting = True
        self._emit(text)
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001
            pass
        self._abort(3)

    def _mpi_abort(self, code: int) -> None:
        abort_job(self.comm, code)      # the report went out through _emit

    # ---- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict | None:
        """Rank 0: what the side channel refused, by reason (for summary.json)."""
        if self.rank != 0:
            return None
        return {"dropped": {k: v for k, v in self.dropped.items() if v},
                "stall_reports": len(self.reports)}

    def close(self, why: str = "finished") -> None:
        """Stop the thread. Not collective: ranks leave at different times."""
        if self._stop.is_set():
            return
        if self.rank != 0:
            self._send({"r": self.rank, "bye": why})
        self._stop.set()
        self._thread.join(timeout=1.0)
        try:
            self._say_if_never_heard()
        except Exception:  # noqa: BLE001 - closing must not fail a finished run
            pass
        self._sock.close()
        if self.rank == 0 and any(self.dropped.values()):
            # once per run, never per datagram: a flood cannot fill the log
            counts = ", ".join(f"{k} {v}" for k, v in self.dropped.items() if v)
            try:
                self.out.write(f"hpc_rlx: warning: the stall watchdog dropped "
                               f"{sum(self.dropped.values())} datagram(s) that were not this "
                               f"job's heartbeats ({counts})\n")
                self.out.flush()
            except Exception:  # noqa: BLE001
                pass
        if current() is self:
            install(None)

    def __enter__(self):
        install(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close("finished" if exc_type is None else f"raised {exc_type.__name__}")
        return False


def _null_enter(self):
    install(None)
    return self


NullWatchdog.__enter__ = _null_enter
NullWatchdog.__exit__ = lambda self, *a: False
