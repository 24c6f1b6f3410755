"""Timeline of a run as a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

`trace.enabled=true` makes every rank record spans (forward/backward per lane, allreduce and
its chunks, optimizer step, batch gathering, data loading, evaluation, checkpoints) into a
list in memory. At the end of the run rank 0 gathers the lists once and writes
`RUN_DIR/trace.json`: one process per rank, one thread track per lane plus the rank's main
loop, timestamps on rank 0's clock.

Cost: disabled, each instrumented site does one module-global `None` check (`ACTIVE`);
enabled, a span is two clock reads and a few appends to flat arrays. Events are not kept as
Python objects (a tuple per event would be tracked by the garbage collector, and collections
walking a growing event list cost more than the recording itself).

Clock alignment: each rank times with its own monotonic clock. Rank 0 estimates every other
rank's clock offset by ping-pong (the round with the smallest round trip, NTP style) once when
tracing starts and once at the end, and corrects each event by the offset interpolated
linearly between the two, so a slow drift between nodes is taken out as well. Every timestamp
(a span's start and its end alike) goes through the same increasing map to rank 0's clock, so
spans a rank recorded one after the other still follow each other, and nested spans still nest,
whatever drift the two measurements suggest (under load their noise can read as a drift of
1e-4, tens of microseconds over a long span).

Waiting: a collective cannot finish anywhere before the last rank has entered it, so the time
between a rank entering the first chunk of an allreduce (the allreduce itself when it is one
chunk) and the last rank entering it is that rank's wait. Rank 0 derives these `wait` spans from the aligned timestamps after the merge
(no extra communication while training).
"""

from __future__ import annotations

import json
import os
import time
from array import array
from pathlib import Path
from typing import Callable

import numpy as np

MAIN = "main"
# Events kept per rank; beyond this they are counted, not stored (memory stays bounded).
DEFAULT_MAX_EVENTS = 500_000
_PING_ROUNDS = 8
_PING_TAG = 7301

# The tracer of this process, or None. Instrumented code reads it once per site.
ACTIVE: "Tracer | None" = None


class _NullSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NULL = _NullSpan()


def span(name: str, cat: str = "", track: str = MAIN, args: dict | None = None):
    """`with trace.span("optimizer", "optim"):` records a span when tracing is on, else nothing."""
    tr = ACTIVE
    if tr is None:
        return _NULL
    return _Span(tr, name, cat, track, args)


class _Span:
    __slots__ = ("tr", "name", "cat", "track", "args", "t0")

    def __init__(self, tr: "Tracer", name: str, cat: str, track: str, args):
        self.tr, self.name, self.cat, self.track, self.args = tr, name, cat, track, args

    def __enter__(self):
        self.t0 = self.tr.clock()
        return self

    def __exit__(self, *exc):
        self.tr.add(self.name, self.cat, self.track, self.t0, self.tr.clock(), self.args)
        return False


class Tracer:
    """Span recorder of one rank. `events` lists (name, cat, track, t0_s, t1_s, args or None).

    Storage is columnar: a kind id per event (name, cat, track), two doubles of time, and the
    args dict or None (dicts of plain numbers and strings are not tracked by the collector)."""

    def __init__(self, rank: int = 0, host: str = "", clock: Callable[[], float] = time.perf_counter,
                 max_events: int = DEFAULT_MAX_EVENTS):
        self.rank, self.host, self.clock = rank, host, clock
        self.max_events = int(max_events)
        self._kind_of: dict[tuple, int] = {}
        self._kinds: list[tuple] = []
        self._kind_ids = array("l")
        self._times = array("d")
        self._args: list = []
        self._room = self.max_events
        self.dropped = 0
        self.seq = 0
        self.t_start = clock()
        self.sync_start: dict | None = None   # rank 0: {rank: (offset_s, at_s)}
        self.sync_end: dict | None = None

    def now(self) -> float:
        return self.clock()

    def span(self, name: str, cat: str = "", track: str = MAIN, args: dict | None = None) -> _Span:
        return _Span(self, name, cat, track, args)

    def add(self, name: str, cat: str, track: str, t0: float, t1: float, args: dict | None = None) -> None:
        if self._room:
            self._room -= 1
            key = (name, cat, track)
            k = self._kind_of.get(key)
            if k is None:
                k = self._kind_of[key] = len(self._kinds)
                self._kinds.append(key)
            self._kind_ids.append(k)
            self._times.append(t0)
            self._times.append(t1)
            self._args.append(args)
        else:
            self.dropped += 1

    @property
    def events(self) -> list[tuple]:
        kinds, t = self._kinds, self._times
        return [kinds[k] + (t[2 * i], t[2 * i + 1], a)
                for i, (k, a) in enumerate(zip(self._kind_ids, self._args))]

    def next_seq(self) -> int:
        """Number of the next collective; identical on every rank because all ranks issue the
        bucket allreduces in the same order."""
        self.seq += 1
        return self.seq


# --------------------------------------------------------------------------------------
# Clock offsets (pure math, then the MPI exchange)
# --------------------------------------------------------------------------------------

def offset_from_pings(samples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(offset, rtt, root_time) from ping-pong rounds (t_send_root, t_remote, t_recv_root).

    offset = remote clock - root clock, taken from the round with the smallest round trip,
    whose midpoint brackets the remote reading most tightly (error <= rtt / 2).
    """
    if not samples:
        raise ValueError("no ping samples")
    t0, t1, t2 = min(samples, key=lambda s: s[2] - s[0])
    mid = 0.5 * (t0 + t2)
    return t1 - mid, t2 - t0, mid


def measure_offsets(comm, clock: Callable[[], float], rounds: int = _PING_ROUNDS) -> dict | None:
    """Collective. Rank 0 returns {rank: (offset_s, root_time_s)}; other ranks return None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = np.zeros(1, dtype=np.float64)
    out = {0: (0.0, clock())} if rank == 0 else None
    for r in range(1, size):
        if rank == 0:
            pings = []
            for _ in range(rounds):
                t0 = clock()
                buf[0] = t0
                comm.Send(buf, dest=r, tag=_PING_TAG)
                comm.Recv(buf, source=r, tag=_PING_TAG)
                t2 = clock()
                pings.append((t0, float(buf[0]), t2))
            off, _, at = offset_from_pings(pings)
            out[r] = (off, at)
        elif rank == r:
            for _ in range(rounds):
                comm.Recv(buf, source=0, tag=_PING_TAG)
                buf[0] = clock()
                comm.Send(buf, dest=0, tag=_PING_TAG)
    return out


# Bound on the drift rate taken from the two offset measurements. Real clocks drift by parts
# per million; the bound only keeps the remote-to-root map increasing (it would fold back at 1).
_MAX_DRIFT = 0.5


def offset_at(t_remote: float, start: tuple[float, float], end: tuple[float, float] | None) -> float:
    """Offset of a remote clock at remote time t, interpolated between two measurements
    (offset, root_time). Outside the interval it extrapolates the same line."""
    o0, a0 = start
    if end is None or end[1] == a0:
        return o0
    o1, a1 = end
    drift = min(max((o1 - o0) / (a1 - a0), -_MAX_DRIFT), _MAX_DRIFT)
    # root time of the event is about t_remote - o0; drift is tiny, one step suffices
    t_root = t_remote - o0
    return o0 + drift * (t_root - a0)


def to_root_time(t_remote: float, start: tuple[float, float], end: tuple[float, float] | None) -> float:
    """Remote clock reading -> rank 0's clock. Linear with slope 1 - drift > 0, so it keeps the
    order of any two readings: apply it to every timestamp, never one span's offset to another
    timestamp (with drift that moves spans against each other)."""
    return t_remote - offset_at(t_remote, start, end)


# --------------------------------------------------------------------------------------
# Start / finish (collective) and the Chrome trace format
# --------------------------------------------------------------------------------------

def start(comm, enabled: bool, host: str = "", max_events: int | None = None,
          clock: Callable[[], float] = time.perf_counter) -> "Tracer | None":
    """Collective when enabled: set up this process's tracer and measure the clock offsets."""
    global ACTIVE
    if not enabled:
        ACTIVE = None
        return None
    tr = Tracer(comm.Get_rank(), host, clock, max_events or DEFAULT_MAX_EVENTS)
    tr.sync_start = measure_offsets(comm, clock)
    ACTIVE = tr
    return tr


def finish(comm, tracer: "Tracer | None", path: str | os.PathLike | None) -> dict | None:
    """Collective: gather every rank's events on rank 0 and write one Chrome trace to `path`.

    Returns the trace dict on rank 0 (None elsewhere, or when tracing was off)."""
    global ACTIVE
    ACTIVE = None
    if tracer is None:
        return None
    tracer.sync_end = measure_offsets(comm, tracer.clock)
    mine = {"rank": tracer.rank, "host": tracer.host, "events": tracer.events, "dropped": tracer.dropped}
    gathered = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    doc = merge(gathered, tracer.sync_start or {}, tracer.sync_end, origin=tracer.t_start)
    if path is not None:
        write(doc, path)
    return doc


def merge(per_rank: list[dict], sync_start: dict, sync_end: dict | None, origin: float) -> dict:
    """Rank-0 side: align clocks, add wait spans, and build the Chrome trace document."""
    aligned = []
    offsets = {}
    for part in per_rank:
        r = part["rank"]
        start_ = sync_start.get(r, (0.0, origin))
        end_ = sync_end.get(r) if sync_end else None
        offsets[r] = {"start_s": start_[0], "end_s": end_[0] if end_ else None}
        evs = []
        for name, cat, track, t0, t1, args in part["events"]:
            evs.append([name, cat, track, to_root_time(t0, start_, end_) - origin,
                        to_root_time(t1, start_, end_) - origin, args])
        aligned.append((part, evs))
    complete = all(p["dropped"] == 0 for p, _ in aligned)
    waits = infer_waits({p["rank"]: evs for p, evs in aligned}) if complete else {}

    trace_events = []
    for part, evs in aligned:
        r = part["rank"]
        tracks = _track_ids(evs)
        trace_events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                             "args": {"name": f"rank {r}" + (f" ({part['host']})" if part["host"] else "")}})
        trace_events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                             "args": {"sort_index": r}})
        for track, tid in tracks.items():
            trace_events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid,
                                 "args": {"name": track}})
            trace_events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid,
                                 "args": {"sort_index": tid}})
        for name, cat, track, t0, t1, args in evs + waits.get(r, []):
            # start and end are rounded each on its own (rounding keeps their order), so a span
            # ending where the next begins gets the same microsecond value for both
            ts = round(t0 * 1e6, 3)
            ev = {"ph": "X", "name": name, "cat": cat or "run", "pid": r, "tid": tracks[track],
                  "ts": ts, "dur": round(max(round(t1 * 1e6, 3) - ts, 0.0), 3)}
            if args:
                ev["args"] = args
            trace_events.append(ev)
    return {
        "traceEvents": trace_events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "per-rank perf_counter, aligned to rank 0 by ping-pong offset "
                     "(measured at start and end, linear in between)",
            "offsets_s": {str(k): v for k, v in offsets.items()},
            "dropped_events": {str(p["rank"]): p["dropped"] for p, _ in aligned},
            "waits_inferred": complete,
        },
    }


def _track_ids(evs: list) -> dict:
    """main first, then the lanes in order of appearance."""
    ids = {MAIN: 0}
    for ev in evs:
        if ev[2] not in ids:
            ids[ev[2]] = len(ids)
    return ids


def infer_waits(per_rank: dict[int, list]) -> dict[int, list]:
    """`wait` spans from aligned first-chunk spans: rank r waited from entering chunk 0 of
    collective `seq` (or the allreduce, when it has a single chunk and so no chunk spans)
    until the last rank entered it (capped at r's own end of that span)."""
    firsts: dict[int, dict[int, list]] = {}
    for r, evs in per_rank.items():
        singles = {}
        for ev in evs:
            args = ev[5]
            if not args or "seq" not in args:
                continue
            if ev[0] == "chunk" and args.get("i") == 0:
                firsts.setdefault(args["seq"], {})[r] = ev
            elif ev[0] == "allreduce" and args.get("chunks") == 1:
                singles[args["seq"]] = ev
        for seq, ev in singles.items():      # a chunk span, where there is one, is the tighter parent
            firsts.setdefault(seq, {}).setdefault(r, ev)
    out: dict[int, list] = {}
    for seq, by_rank in firsts.items():
        if len(by_rank) != len(per_rank):
            continue
        last_in = max(ev[3] for ev in by_rank.values())
        for r, ev in by_rank.items():
            end = min(last_in, ev[4])
            if end > ev[3]:
                out.setdefault(r, []).append(["wait", "wait", ev[2], ev[3], end, {"seq": seq}])
    return out


def write(doc: dict, path: str | os.PathLike) -> Path:
    """Atomic write (a half-written trace would not load in the viewer)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def summarize(doc: dict) -> dict[str, float]:
    """Total seconds per span name over all ranks (for text reports)."""
    totals: dict[str, float] = {}
    for ev in doc.get("traceEvents", []):
        if ev.get("ph") == "X":
            totals[ev["name"]] = totals.get(ev["name"], 0.0) + ev["dur"] * 1e-6
    return totals
