"""Everything MPI: collective error agreement, spec/array broadcast, the fused bucket and abort.

The bucket's memory (layout, host arrays, device twin, transfers) is `bucket_memory`'s; its
reduction paths (host, ordered, 16-bit wire, staged, CUDA-aware) are in `reduce`, by name in
`registry` (``comm.reduction``), and which one sums it is `path_choice`'s decision.

Idioms: lowercase `bcast`/`allgather` only for small Python objects (the spec, status
strings); uppercase buffer collectives for arrays, so arrays are never pickled.
"""

from __future__ import annotations

import functools
import time
import traceback
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from hpc_rlx.comm import idle_wait
from hpc_rlx.comm import watchdog as _watchdog
from hpc_rlx.comm.bucket_layout import BucketLayout
from hpc_rlx.comm.bucket_memory import BucketMemory
from hpc_rlx.comm.finite import all_finite
from hpc_rlx.comm.job_abort import abort_job
from hpc_rlx.comm.node_memory import NodeSharedSum
from hpc_rlx.comm.node_scatter import NodeScatteredSum
from hpc_rlx.comm.overlap import OverlapPlan, OverlapStep
from hpc_rlx.comm.path_choice import (ReductionSettings, choose_reduction, exact_path, placement_for,
                                      shared_memory_refusal)
from hpc_rlx.comm.reduce import ring_bytes
from hpc_rlx.comm.registry import AUTO
from hpc_rlx.comm.shard import ParamShard
from hpc_rlx.base.topology import hostname, rank_span
from hpc_rlx.comm.wire_volume import WireCount
from hpc_rlx.base import cuda_mpi
from hpc_rlx.base.errors import HpcRlxError
from hpc_rlx.base import trace


def world():
    """The MPI world communicator (imports and initialises MPI on first call)."""
    from mpi4py import MPI
    return MPI.COMM_WORLD


# --------------------------------------------------------------------------------------
# Errors decided collectively: every rank raises the same message, nobody is left waiting.
# --------------------------------------------------------------------------------------

class CollectiveError(HpcRlxError):
    """A user-facing error agreed by all ranks. `origin` is the rank that first hit it,
    `host` the node it runs on."""

    def __init__(self, message: str, kind: str = "HpcRlxError", origin: int = 0,
                 host: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.origin = origin
        self.host = host


def _status(exc: BaseException | None) -> tuple | None:
    if exc is None:
        return None
    if isinstance(exc, CollectiveError):
        return (exc.kind, str(exc), exc.host or hostname())
    if isinstance(exc, HpcRlxError):
        return (type(exc).__name__, str(exc), hostname())
    # A bug, not bad input: keep the traceback so it can be fixed.
    return (type(exc).__name__, "".join(traceback.format_exception(exc)).rstrip(), hostname())


def watched_call(label: str, call: Callable, *args, **kwargs):
    """Run one collective under the stall watchdog (`hpc_rlx.comm.watchdog`): it only notes
    entering and leaving, so a call costs two attribute writes, no message."""
    wd = _watchdog.current()
    wd.enter(label)
    try:
        return call(*args, **kwargs)
    finally:
        wd.leave()


def watched(label: str):
    """Decorator form of `watched_call`."""
    def wrap(method):
        @functools.wraps(method)
        def inner(*args, **kwargs):
            return watched_call(label, method, *args, **kwargs)
        return inner
    return wrap


def agree(comm, fn: Callable[[], Any]) -> Any:
    """Run `fn` on every rank; if it fails anywhere, every rank raises the same error.

    The lowest failing rank's message wins, so the message is identical everywhere.
    """
    try:
        result, exc = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised collectively below
        result, exc = None, e
    statuses = watched_call("error agreement (allgather)", idle_wait.allgather, comm, _status(exc))
    for rank, st in enumerate(statuses):
        if st is not None:
            raise CollectiveError(st[1], kind=st[0], origin=rank, host=st[2]) from exc
    return result


def root_computes(comm, fn: Callable[[], Any], root: int = 0) -> Any:
    """Rank `root` runs `fn` and broadcasts its (small, picklable) result or its error."""
    payload = None
    if comm.rank == root:
        try:
            payload = ("ok", fn())
        except Exception as e:  # noqa: BLE001
            payload = ("err", _status(e))
    payload = watched_call(f"broadcast of rank {root}'s result", idle_wait.bcast, comm, payload, root=root)
    if payload[0] == "err":
        kind, message, host = payload[1]
        raise CollectiveError(message, kind=kind, origin=root, host=host)
    return payload[1]


def abort(comm, message: str, code: int = 1) -> None:
    """Print one message and take the whole MPI job down (no rank may be left waiting)."""
    abort_job(comm, code, message)


# --------------------------------------------------------------------------------------
# The fused bucket
# --------------------------------------------------------------------------------------

class FusedBucket:
    """One contiguous array laid out by a `bucket_layout.BucketLayout`:
    [gradients or weighted params ... | summed fields | per-rank fields].

    Lanes write gradients straight into `payload` views, the loop writes counts, loss sums
    and flags into the tail, and one in-place SUM Allreduce (chunked under the size cap)
    gives every rank the global sums of all of it at once.

    The bucket's memory is one `bucket_memory.BucketMemory` (`memory`): the layout, the host
    arrays (`buffer`, `payload`, `tail`), the device twin on the lead GPU (`attach_device`) and
    the explicit transfers between the two (`memory.payload_to_host()`, ...); its settings are
    `settings` (`settings.chunk_elems`, ...). What a step writes and reads of it, the bucket
    declares itself: the layout, the host arrays and the named fields (`bucket["samples"]`,
    `put`, `flags`, `zero_tail`). The bucket itself holds how it is summed.

    How the Allreduce runs is one `hpc_rlx.comm.reduce` path (`reduction`), which
    `path_choice.choose_reduction` picks again whenever the memory or the world changes
    (`_choose`): the one ``reduction`` names (``comm.reduction``, `hpc_rlx.comm.registry`), or
    by default host, ordered (``comm.deterministic``) or 16-bit wire (``comm.wire_dtype``:
    bfloat16 | float16, half the bytes, float32 sums); staged through the host, or CUDA-aware
    directly on the device; the node's shared window (`share_node_memory`); reduce-scattered
    under ``comm.shard=optimizer``, where the path also gathers the parameters back
    (`gather_params`).
    """

    overlap_progress = True     # comm.overlap: MPI Test calls from the executor's callback
                                # (measured by bench/bench_overlap.py, which turns it off)

    def __init__(self, payload_size: int, tail_fields: Sequence[str], dtype, xp=np,
                 cap_mb: float = 16.0, deterministic: bool = False, wire_dtype: str | None = None,
                 rank_fields: Sequence[str] = (), world_size: int = 1,
                 overlap: bool = False, overlap_chunk_mb: float = 1.0, reduction: str = AUTO,
                 shard: ParamShard | None = None, shared_params=None):
        # comm.overlap: tail first, so the chunk started last (backward ends at the payload's
        # start) carries the tail (`comm.overlap`)
        layout = BucketLayout(payload_size, tail_fields, rank_fields, world_size, tail_first=overlap)
        self.memory = BucketMemory(layout, dtype, xp)
        itemsize = np.dtype(dtype).itemsize
        self.settings = ReductionSettings.of(max(1, int(cap_mb * 1024 * 1024) // itemsize), deterministic,
                                             wire_dtype, reduction, shard, shared_params)
        self.last_chunks = 0
        self.last_wire_bytes = 0        # bytes this rank sent in the last allreduce
        self.sent = WireCount()         # ... in every allreduce, and the sharded allgather
        self.last_path = cuda_mpi.HOST
        self.choice = None              # cuda_mpi.PathChoice once lanes placed the bucket
        self.overlap = bool(overlap)
        self.shared_memory_off: str | None = None   # why comm.shared_memory could not be used
        self.overlap_chunk_elems = max(1, int(overlap_chunk_mb * 1024 * 1024) // itemsize)
        self._overlap_plan = None
        self._overlap_spans: dict = {}
        self._overlap_step = None
        self._choose()

    # ---- what a step writes and reads: the memory's layout, host arrays and named fields ------
    # (properties: the memory moves its arrays, into page-locked memory or a shared window)
    @property
    def layout(self) -> BucketLayout:
        return self.memory.layout

    @property
    def buffer(self):
        """The whole host array: payload, then tail."""
        return self.memory.buffer

    @property
    def payload(self):
        """The host payload: gradients or weighted parameters."""
        return self.memory.payload

    @payload.setter
    def payload(self, value) -> None:
        # `bucket.payload /= n` works in place, then assigns the same array back: nothing else
        if value is not self.memory.payload:
            raise AttributeError("a bucket's payload is written in place (bucket.payload[...] = ...)")

    @property
    def tail(self):
        """The named fields, on the host."""
        return self.memory.tail

    def __getitem__(self, field: str):
        """A summed field as a float; a per-rank field as its slots (a view of the tail)."""
        return self.memory[field]

    def __setitem__(self, field: str, value: float) -> None:
        self.memory[field] = value

    def put(self, field: str, value: float, rank: int) -> None:
        """This rank's slot of a per-rank field (or a summed field: `rank` is ignored)."""
        self.memory.put(field, value, rank)

    def flags(self) -> dict[str, bool]:
        """The control flags, as the last sum left them."""
        return self.memory.flags()

    def zero_tail(self) -> None:
        self.memory.zero_tail()

    @property
    def communicators(self) -> tuple:
        """The communicators its path made of its own (the node's shared window's), where a dead
        rank may show first (`resilience.in_run`)."""
        return self.reduction.communicators

    def _choose(self) -> None:
        """The memory or the world changed: the reduction path again (the only place it is set)."""
        self.reduction = choose_reduction(self.settings, self.choice, self.memory.window)

    # ---- placement: chosen once, when the lanes are built -----------------------------------
    def attach_device(self, device: int, choice) -> None:
        """Give the bucket a twin on GPU `device`, move the host side to page-locked memory,
        and reduce by `choice` (staged or CUDA-aware). Call before anyone keeps a view of
        `payload` or `buffer`."""
        self.memory.attach_device(device)
        self.set_choice(choice)

    def set_choice(self, choice) -> None:
        """Reduce where the lanes placed the bucket (`cuda_mpi.PathChoice`); a device bucket
        whose path sums host memory is staged."""
        self.choice = placement_for(self.settings, choice)
        self._choose()

    def exact_reduction(self):
        """The path of a use that must sum the host array as it is, whatever the step's path
        (`path_choice.exact_path`). The windowed policies' sync picks it once, at its setup,
        and hands it to every `allreduce`."""
        return exact_path(self.settings, self.reduction)

    # ---- the node's shared memory (comm.shared_memory) ---------------------------------------
    def share_node_memory(self, comm, cpu_only: bool) -> bool:
        """Collective: move the bucket into the node's shared window and sum it there
        (`hpc_rlx.comm.node_memory`) when every rank can; True where it did (on every rank).
        Only where `path_choice.shared_memory_refusal` has no reason, and before anyone keeps
        a view of `buffer` or `payload`."""
        if comm.size == 1:
            return False                 # nothing to share, nothing to report
        sharded = self.settings.shard is not None    # its reduce-scatter in the window (one node only)
        memory = self.memory
        why_not = shared_memory_refusal(self.settings, self.reduction, cpu_only=cpu_only,
                                        on_device=memory.device is not None, overlap=self.overlap)
        shared, self.shared_memory_off = (NodeScatteredSum if sharded else NodeSharedSum).create(
            comm, memory.buffer.shape[0], memory.buffer.dtype, self.settings.chunk_elems, why_not)
        if shared is None:
            return False
        if sharded:
            if shared.cross.size > 1 and self.settings.deterministic:    # the same on every rank
                self.shared_memory_off = (f"comm.deterministic=true across {shared.cross.size} nodes (the "
                                          f"sharded sum adds in rank order: MPI's reduce-scatter)")
                shared.free()
                return False
            shared.attach(comm, self.settings.shard, memory.layout, self.settings.shared_params)
        memory.share(shared)
        shared.before_free = weakref.WeakMethod(self._leave_node_memory)
        self._choose()
        return True

    def _leave_node_memory(self) -> None:
        """Back to a private buffer with the last values and MPI's Allreduce (the window is
        about to be freed)."""
        if self.memory.window is not None:
            self.memory.leave_window(copy=True)
            self._choose()

    def abandon_node_memory(self) -> bool:
        """After a rank of the job died: leave the node's shared window without freeing it
        (`NodeSharedSum.abandon`); its segment stays this rank's buffer, so every view of the
        bucket stays valid, and MPI's Allreduce sums it from now on. True where it was shared."""
        window = self.memory.window
        if window is None:
            return False
        window.abandon()
        self.memory.leave_window(copy=False)
        self._choose()
        self.shared_memory_off = "abandoned after a failure"
        return True

    def release_node_memory(self) -> None:
        """Collective over the node: free the shared window now, the bucket keeping a private
        copy of its last values. A run leaves its window to the next window's setup (one per
        process at a time: sharing another bucket releases this one) or to MPI_Finalize, so
        views of the bucket taken during the run stay valid; see `node_memory`."""
        if self.memory.window is not None:
            self.memory.window.free()

    # ---- the world changed (a failure shrank the job) ----------------------------------------
    def world_changed(self, world_size: int) -> bool:
        """The ranks changed: `world_size` now train. The node's shared window is left (without
        freeing: `abandon_node_memory`), the per-rank slots are laid out for `world_size` ranks
        in the same memory (every view of the payload stays valid), and the path is chosen
        again. True where the shared window was left here."""
        left = self.abandon_node_memory()
        if self.memory.relayout(world_size):
            self.set_overlap_spans(self._overlap_spans)
        self._choose()
        return left

    def describe(self) -> str:
        """Where the bucket lives and how it is reduced, in one line (logged at start-up)."""
        settings, device = self.settings, self.memory.device
        where = "host" if device is None else f"GPU {device}"
        path = self.choice.describe() if self.choice is not None else "host"
        if self.reduction.in_node_memory:
            path = self.reduction.path
        wire = f", wire {settings.wire} (float32 sums; tail uncompressed)" if settings.wire else ""
        named = f", reduction {settings.reduction_name}" if settings.reduction_name != AUTO else ""
        named += ", reduce-scatter (comm.shard=optimizer)" if settings.shard is not None else ""
        off = f"; shared-memory sum off: {self.shared_memory_off}" if self.shared_memory_off else ""
        return f"bucket on {where}, path {path}{wire}{named}{off}"

    # ---- overlap with backward (`comm.overlap`, `hpc_rlx.comm.overlap`) ---------------------
    def set_overlap_spans(self, spans: dict) -> None:
        """{name: (lo, hi)}: where each parameter's (and buffer's) gradient sits in the payload."""
        self._overlap_spans = spans
        if self.overlap:
            self._overlap_plan = OverlapPlan(self.memory.layout, spans, self.overlap_chunk_elems)

    def begin_overlap(self, comm):
        """Start a step's overlap; returns the executor's ``on_grad_ready`` callback (None when
        overlap is off or not possible: only a host bucket summed by MPI's own SUM, not
        ordered, not the 16-bit wire, no GPU twin). The next `allreduce` finishes what this
        started."""
        if self._overlap_plan is None or not self.reduction.overlappable or self.memory.device is not None:
            return None
        self._overlap_step = OverlapStep(self._overlap_plan, self.memory.buffer, comm, all_finite,
                                         self.overlap_progress)
        return self._overlap_step.ready

    def payload_finite(self) -> bool:
        """Whether every payload value is finite, checked where the newest payload lives."""
        if self._overlap_step is not None:
            return self._overlap_step.payload_finite()
        return self.memory.payload_finite()

    # ---- the collectives ------------------------------------------------------------------
    @watched("fused-bucket Allreduce")
    def allreduce(self, comm, reduction=None) -> float:
        """Sum the whole bucket over all ranks in place, by this bucket's reduction path, or by
        `reduction` (a path its caller chose once, e.g. `exact_reduction`), or finish the chunks
        `begin_overlap` started during backward. Returns seconds spent here: with overlap, only
        the exposed part."""
        t0 = time.perf_counter()
        tr = trace.ACTIVE
        seq = tr.next_seq() if tr is not None else 0
        step, self._overlap_step = self._overlap_step, None
        span_t0 = t0
        nbytes = int(self.memory.buffer.nbytes)
        if step is not None:
            self.last_chunks = step.finish(seq)
            self.last_wire_bytes = ring_bytes(comm, nbytes)    # MPI's Allreduce: computed
            self.last_path = "host, overlapped"
            span_t0 = min(t0, step.t_first or t0)   # the span starts with the first chunk, in backward
        else:
            done = (self.reduction if reduction is None else reduction).run(self.memory, comm, seq)
            self.last_chunks = done.chunks
            self.last_wire_bytes = done.wire_bytes
            self.last_path = done.path
        self.sent.add(self.last_wire_bytes)
        t1 = time.perf_counter()
        if tr is not None:
            tr.add("allreduce", "comm", trace.MAIN, span_t0, t1, {"seq": seq, "bytes": nbytes,
                                                             "chunks": self.last_chunks, "path": self.last_path})
        return t1 - t0

    def gather_params(self, comm, params) -> None:
        """``comm.shard=optimizer``, after each rank stepped its slice: every slice of `params`
        to every rank, in place, the way the reduction path gathers (its `gather_params`: MPI
        rounds, the node's segments, or the node's one parameter array); its bytes count in
        `sent`."""
        if not self.reduction.gathers_params:
            raise HpcRlxError(f"the bucket's path ({self.reduction.path}) does not gather parameters")
        self.sent.add(self.reduction.gather_params(comm, params))


def by_rank(comm, text: str) -> str | None:
    """Rank 0: ``text`` of every rank, grouped ("A on ranks 0-3; B on ranks 4-7"); others: None."""
    texts = comm.gather(text, root=0)
    if comm.rank != 0:
        return None
    groups: dict[str, list[int]] = {}
    for r, t in enumerate(texts):
        groups.setdefault(t, []).append(r)
    if len(groups) == 1:
        return text if comm.size == 1 else f"{text} (all {comm.size} ranks)"
    return "; ".join(f"{t} on ranks {rank_span(rs)}" for t, rs in groups.items())
