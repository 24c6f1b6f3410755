"""Overlap of the fused bucket's Allreduce with backward (``comm.overlap=true``, policy `sync`).

Backward finishes gradients last layer first, i.e. from the END of the parameter layout
(`graph.params.ParamLayout`: trainable parameters in declaration order, then buffers). The
bucket is laid out tail first (`bucket_layout.BucketLayout(tail_first=True)`):

```
[ tail | payload ]      cut from the end into chunks of comm.overlap_chunk_mb:
  [0, c0) ... [.., size-c) [size-c, size)
  started last            started first (as soon as backward finished every gradient in it)
```

The executor calls `OverlapStep.ready(name)` when a parameter's gradient (or a buffer's
statistic) is final; a chunk whose payload elements are all final starts a non-blocking SUM
Iallreduce in place, strictly in order from the end, so every rank starts the same
collectives in the same order whatever order the callbacks come in. The chunks holding the
tail or the payload's first element (`debug.nan_rank` writes there) are held until `finish`,
after the loop wrote the sample count, sums and flags: the non-finite flag covers every
gradient because each chunk is checked for finiteness right before it starts (`finite`),
and the rest by `payload_finite` before the tail is written. `finish` starts what is left and
waits for all of it: every rank gets the exact global sums, as with the blocking path.

MPICH progresses non-blocking collectives only inside MPI calls, so `ready` also tests the
oldest request in flight (``progress``; measured in bench/README.md, "Overlap").
Only for a host bucket summed by MPI's SUM (`reduce.HostSum`) with one lane writing
straight into it; `comm.deterministic`, the 16-bit wire and GPU buckets keep the blocking path.
"""

from __future__ import annotations

import time

from hpc_rlx.base import trace


def _mpi():
    from mpi4py import MPI
    return MPI


class OverlapPlan:
    """Fixed per run: the chunks of a tail-first bucket and which parameter touches which."""

    def __init__(self, layout, spans: dict, chunk_elems: int):
        """``layout``: the bucket's `BucketLayout` (tail first); ``spans``: {name: (lo, hi)}
        payload offsets of every parameter and buffer; ``chunk_elems``: elements per chunk."""
        if not layout.tail_first:
            raise ValueError("overlap needs a tail-first bucket layout")
        self.size, self.base, self.c = layout.size, layout.payload_start, max(1, int(chunk_elems))
        self.n = (self.size + self.c - 1) // self.c
        # chunk k (issued k-th) is [lo_k, hi_k), counted from the end of the bucket
        self.bounds = [(max(0, self.size - (k + 1) * self.c), self.size - k * self.c) for k in range(self.n)]
        # held until finish: chunks with tail elements or the payload's first element
        self.first_held = min(k for k, (lo, _) in enumerate(self.bounds) if lo <= self.base)
        self.payload_count = [max(0, hi - max(lo, self.base)) for lo, hi in self.bounds]
        self.touch = {}     # name -> [(chunk, elements of it)]
        for name, (lo, hi) in spans.items():
            a, b = self.base + lo, self.base + hi
            if b <= a:
                self.touch[name] = []
                continue
            ks = range((self.size - b) // self.c, (self.size - 1 - a) // self.c + 1)
            self.touch[name] = [(k, min(b, self.bounds[k][1]) - max(a, self.bounds[k][0])) for k in ks]


class OverlapStep:
    """One step's chunks in flight over ``buffer`` (see the module docstring)."""

    def __init__(self, plan: OverlapPlan, buffer, comm, all_finite, progress: bool = True):
        self.plan, self.buffer, self.comm = plan, buffer, comm
        self.all_finite, self.progress = all_finite, progress
        self.remaining = list(plan.payload_count)
        self.next = 0           # the next chunk to start (chunks start in order)
        self.requests, self.started, self.finite = [], [], True
        self.seen = set()
        self.tested = 0         # requests before this one are known complete
        self.done_at = {}       # request index -> when a Test saw it complete
        self.t_first = None

    def ready(self, name: str) -> None:
        """The executor's callback: ``name``'s slot of the payload is final."""
        if name in self.seen:        # a name twice (several lanes) must not count twice
            return
        self.seen.add(name)
        rem = self.remaining
        for k, count in self.plan.touch[name]:
            rem[k] -= count
        held = self.plan.first_held
        while self.next < held and rem[self.next] == 0:
            self._start(self.next, check=True)
        if self.progress and self.tested < len(self.requests):
            if self.requests[self.tested].Test():
                self.done_at[self.tested] = time.perf_counter()
                self.tested += 1

    def _start(self, k: int, check: bool) -> None:
        lo, hi = self.plan.bounds[k]
        part = self.buffer[lo:hi]
        if check and self.finite:
            self.finite = self.all_finite(part[max(0, self.plan.base - lo):])
        mpi = _mpi()
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.requests.append(self.comm.Iallreduce(mpi.IN_PLACE, part, op=mpi.SUM))
        self.started.append(now)
        self.next = k + 1

    def unstarted_payload(self):
        """The payload part no chunk has started on yet (contiguous: chunks start from the end)."""
        end = self.plan.bounds[self.next][1] if self.next < self.plan.n else 0
        return self.buffer[self.plan.base: max(self.plan.base, end)]

    def payload_finite(self) -> bool:
        """This rank's whole payload is finite: started chunks as checked when they started,
        the rest now."""
        return self.finite and self.all_finite(self.unstarted_payload())

    def finish(self, seq: int) -> int:
        """Start the chunks left (the tail is written by now) and wait for all. Returns chunks."""
        while self.next < self.plan.n:
            self._start(self.next, check=False)
        mpi = _mpi()
        tr = trace.ACTIVE
        if tr is None:
            mpi.Request.Waitall(self.requests)
            return len(self.requests)
        # traced: each chunk's span ends when it was seen complete (by a Test during backward,
        # or here), so the trace shows which reductions finished under backward
        ends = [self.done_at.get(i) for i in range(len(self.requests))]
        pending = [i for i, t in enumerate(ends) if t is None]
        while pending:
            j = mpi.Request.Waitany([self.requests[i] for i in pending])
            ends[pending.pop(j)] = time.perf_counter()
        for i, (t0, t1, (lo, hi)) in enumerate(zip(self.started, ends, self.plan.bounds)):
            tr.add("chunk", "comm", trace.MAIN, t0, t1,
                   {"seq": seq, "i": i, "bytes": int((hi - lo) * self.buffer.itemsize), "overlap": True})
        return len(self.requests)
