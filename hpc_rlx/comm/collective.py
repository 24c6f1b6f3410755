"""Everything MPI: collective error agreement, spec/array broadcast, the fused bucket and abort.

The bucket's reduction paths (host, ordered, 16-bit wire, staged, CUDA-aware) are in `reduce`,
by name in `registry` (``comm.reduction``).

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
from hpc_rlx.comm.codec import codec_for, normalize_wire
from hpc_rlx.comm.finite import all_finite
from hpc_rlx.comm.job_abort import abort_job
from hpc_rlx.comm.node_memory import NodeSharedSum
from hpc_rlx.comm.node_scatter import NodeScatteredSum
from hpc_rlx.comm.overlap import OverlapPlan, OverlapStep
from hpc_rlx.comm.reduce import StagedSum, ring_bytes
from hpc_rlx.comm.registry import AUTO, exact_name, make_reduction, placement
from hpc_rlx.comm.shard import ParamShard, ScatteredSum
from hpc_rlx.comm.topology import hostname, rank_span
from hpc_rlx.comm.wire_volume import WireCount
from hpc_rlx.device import backend, cuda_mpi
from hpc_rlx.errors import HpcRlxError
from hpc_rlx.observe import trace


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

    `buffer`, `payload` and `tail` are plain host arrays. On a rank whose lanes are all GPUs
    the bucket also has a twin on the lead GPU (`attach_device`): the lanes sum their
    gradients there (`mark_device_fresh`), and the payload comes to the page-locked host array
    only through an explicit `payload_to_host()` (a no-op when the host is newest), which
    whoever reads or writes `payload` after the lanes or the Allreduce calls first. The tail
    always lives on the host and is never compressed.

    How the Allreduce runs is one `hpc_rlx.comm.reduce` path, chosen when the lanes place the
    bucket (`attach_device` / `set_choice`) and kept for the run: the one ``reduction`` names
    (``comm.reduction``, `hpc_rlx.comm.registry`), or by default host, ordered
    (``comm.deterministic``) or 16-bit wire (``comm.wire_dtype``: bfloat16 | float16, half the
    bytes, float32 sums); staged through the host, or CUDA-aware directly on the device.
    """

    overlap_progress = True     # comm.overlap: MPI Test calls from the executor's callback
                                # (measured by bench/bench_overlap.py, which turns it off)

    def __init__(self, payload_size: int, tail_fields: Sequence[str], dtype, xp=np,
                 cap_mb: float = 16.0, deterministic: bool = False, wire_dtype: str | None = None,
                 rank_fields: Sequence[str] = (), world_size: int = 1,
                 overlap: bool = False, overlap_chunk_mb: float = 1.0, reduction: str = AUTO,
                 shard: ParamShard | None = None):
        # comm.overlap: tail first, so the chunk started last (backward ends at the payload's
        # start) carries the tail (`comm.overlap`)
        self.layout = BucketLayout(payload_size, tail_fields, rank_fields, world_size, tail_first=overlap)
        self.payload_size = self.layout.payload_size
        self._set_host(xp.zeros(self.layout.size, dtype=dtype))
        itemsize = np.dtype(dtype).itemsize
        self.chunk_elems = max(1, int(cap_mb * 1024 * 1024) // itemsize)
        self.deterministic = deterministic
        self.wire = normalize_wire(wire_dtype)
        self.last_chunks = 0
        self.last_wire_bytes = 0        # bytes this rank sent in the last allreduce
        self.sent = WireCount()         # ... in every allreduce, and the sharded allgather (Worker)
        self.last_path = cuda_mpi.HOST
        self.device = None              # lead GPU of the device twin, if any
        self.device_buffer = None
        self.device_payload = None
        self.device_tail = None
        self.device_is_newest = False   # the lanes or the Allreduce left the newest payload there
        self.choice = None              # cuda_mpi.PathChoice once lanes placed the bucket
        self.reduction_name = AUTO if reduction is None else reduction     # comm.reduction
        self.shard = shard          # comm.shard=optimizer: the payload is reduce-scattered
        self.reduction = (ScatteredSum(shard, self.chunk_elems, codec_for(self.wire)) if shard is not None else
                          make_reduction(self.chunk_elems, deterministic, self.wire, name=self.reduction_name))
        self.overlap = bool(overlap)
        self.shared_memory_off: str | None = None   # why comm.shared_memory could not be used
        self.overlap_chunk_elems = max(1, int(overlap_chunk_mb * 1024 * 1024) // itemsize)
        self._overlap_plan = None
        self._overlap_spans: dict = {}
        self._overlap_step = None

    def _set_host(self, buf) -> None:
        self.buffer = buf
        self.payload = self.layout.payload_of(buf)
        self.tail = self.layout.tail_of(buf)

    def __getitem__(self, field: str):
        """A summed field as a float; a per-rank field as its slots (a view of the tail)."""
        return self.layout.read(self.tail, field)

    def __setitem__(self, field: str, value: float) -> None:
        self.layout.write(self.tail, field, value)

    def put(self, field: str, value: float, rank: int) -> None:
        """This rank's slot of a per-rank field (or a summed field: `rank` is ignored)."""
        self.layout.write(self.tail, field, value, rank)

    def flags(self) -> dict[str, bool]:
        """The reduced control flags (`bucket_layout.CONTROL_FLAGS`) after the Allreduce."""
        return self.layout.flags(self.tail)

    def zero_tail(self) -> None:
        self.tail[...] = 0

    # ---- placement: chosen once, when the lanes are built -----------------------------------
    def attach_device(self, device: int, choice) -> None:
        """Give the bucket a twin on GPU `device`, move the host side to page-locked memory,
        and reduce by `choice` (staged or CUDA-aware). Call before anyone keeps a view of
        `payload` or `buffer`."""
        host = backend.pinned_empty(self.buffer.shape[0], self.buffer.dtype)
        host[...] = self.buffer
        self._set_host(host)
        self.device = int(device)
        self.device_buffer = backend.device_zeros(host.shape[0], host.dtype, self.device)
        self.device_payload = self.layout.payload_of(self.device_buffer)
        self.device_tail = self.layout.tail_of(self.device_buffer)
        self.device_is_newest = False
        self.set_choice(choice)

    def set_choice(self, choice) -> None:
        if self.shard is not None:      # the reduce-scatter sums host memory: a device bucket is staged
            self.choice = choice if choice.path == cuda_mpi.HOST else cuda_mpi.PathChoice(
                cuda_mpi.STAGED, "comm.shard=optimizer sums in host memory")
            if self.reduction.in_node_memory and choice.path == cuda_mpi.HOST:
                return      # reduce-scattered in the node's shared memory (`node_scatter`)
            inner = ScatteredSum(self.shard, self.chunk_elems, codec_for(self.wire))
            self.reduction = inner if choice.path == cuda_mpi.HOST else StagedSum(inner)
            return
        # a device bucket whose path sums host memory is staged
        self.choice = choice = placement(self.reduction_name, self.deterministic,
                                         codec_for(self.wire), choice)
        if self.reduction.in_node_memory and choice.path == cuda_mpi.HOST:
            return          # already in the node's shared memory: the host path, summed there
        self.reduction = make_reduction(self.chunk_elems, self.deterministic, self.wire, choice,
                                        name=self.reduction_name)

    def exact_reduction(self):
        """The path of a use that must sum the host array as it is, whatever the step's path
        (16-bit wire, device twin): MPI's SUM, or the ordered sum under ``comm.deterministic``,
        chunked as the bucket is, or the node's shared memory when the bucket lives there, or
        the path ``comm.reduction`` names when it is exact. The windowed policies' sync picks it
        once, at its setup, and hands it to every `allreduce`."""
        if self.reduction.in_node_memory:
            return self.reduction
        return make_reduction(self.chunk_elems, self.deterministic, None,
                              name=exact_name(self.reduction_name))

    def share_node_memory(self, comm, cpu_only: bool) -> bool:
        """Collective: move the bucket into the node's shared window and sum it there
        (`hpc_rlx.comm.node_memory`) when every rank can; True where it did (on every rank).
        Only for a host bucket summed by MPI's SUM (not ordered, not the 16-bit wire, not
        overlapped, not a path ``comm.reduction`` names), and before anyone keeps a view of
        `buffer` or `payload`."""
        if comm.size == 1:
            return False                 # nothing to share, nothing to report
        sharded = self.shard is not None    # its reduce-scatter in the window (one node only)
        why_not = ("a GPU lane" if not cpu_only or self.device is not None else
                   "comm.deterministic=true" if self.deterministic and not sharded else
                   f"comm.wire_dtype={self.wire}" if self.wire else
                   "comm.overlap=true" if self.overlap else
                   f"comm.reduction={self.reduction_name}" if self.reduction_name != AUTO else
                   None if sharded or self.reduction.overlappable else "a reduction other than MPI's SUM")
        shared, self.shared_memory_off = (NodeScatteredSum if sharded else NodeSharedSum).create(
            comm, self.buffer.shape[0], self.buffer.dtype, self.chunk_elems, why_not)
        if shared is None:
            return False
        if sharded:
            if shared.cross.size > 1 and self.deterministic:    # the same on every rank
                self.shared_memory_off = (f"comm.deterministic=true across {shared.cross.size} nodes (the "
                                          f"sharded sum adds in rank order: MPI's reduce-scatter)")
                shared.free()
                return False
            shared.attach(comm, self.shard, self.layout)
        shared.segment[...] = self.buffer
        self._set_host(shared.segment)
        self.reduction = shared
        shared.before_free = weakref.WeakMethod(self._leave_node_memory)
        return True

    def _leave_node_memory(self) -> None:
        """Back to a private buffer with the last values and MPI's Allreduce (the window is
        about to be freed)."""
        if self.reduction.in_node_memory:
            self.reduction = (ScatteredSum(self.shard, self.chunk_elems, None) if self.shard is not None
                              else make_reduction(self.chunk_elems, self.deterministic, None))
            self._set_host(self.buffer.copy())

    def abandon_node_memory(self) -> bool:
        """After a rank of the job died: leave the node's shared window without freeing it
        (`NodeSharedSum.abandon`); its segment stays this rank's buffer, so every view of the
        bucket stays valid, and MPI's Allreduce sums it from now on. True where it was shared."""
        if not self.reduction.in_node_memory:
            return False
        self.reduction.abandon()
        self.reduction = make_reduction(self.chunk_elems, self.deterministic, None)
        self.shared_memory_off = "abandoned after a failure"
        return True

    def release_node_memory(self) -> None:
        """Collective over the node: free the shared window now, the bucket keeping a private
        copy of its last values. A run leaves its window to the next window's setup (one per
        process at a time: sharing another bucket releases this one) or to MPI_Finalize, so
        views of the bucket taken during the run stay valid; see `node_memory`."""
        if self.reduction.in_node_memory:
            self.reduction.free()

    def describe(self) -> str:
        """Where the bucket lives and how it is reduced, in one line (logged at start-up)."""
        where = "host" if self.device is None else f"GPU {self.device}"
        path = self.choice.describe() if self.choice is not None else "host"
        if self.reduction.in_node_memory:
            path = self.reduction.path
        wire = f", wire {self.wire} (float32 sums; tail uncompressed)" if self.wire else ""
        named = f", reduction {self.reduction_name}" if self.reduction_name != AUTO else ""
        named += ", reduce-scatter (comm.shard=optimizer)" if self.shard is not None else ""
        off = f"; shared-memory sum off: {self.shared_memory_off}" if self.shared_memory_off else ""
        return f"bucket on {where}, path {path}{wire}{named}{off}"

    # ---- explicit transfers between the host arrays and the device twin ----------------------
    def mark_device_fresh(self) -> None:
        """The lanes (or a CUDA-aware Allreduce) left the newest payload in `device_payload`."""
        if self.device_buffer is None:
            raise HpcRlxError("mark_device_fresh on a bucket without a device twin")
        self.device_is_newest = True

    def payload_to_host(self) -> None:
        """Bring a device-side payload down to `payload` (a no-op when the host is newest)."""
        if self.device_is_newest:
            backend.copy_to_host(self.payload, self.device_payload)
            self.device_is_newest = False

    def tail_to_device(self) -> None:
        backend.copy_to_device(self.device_tail, self.tail)

    def tail_to_host(self) -> None:
        backend.copy_to_host(self.tail, self.device_tail)

    # ---- overlap with backward (`comm.overlap`, `hpc_rlx.comm.overlap`) ---------------------
    def set_overlap_spans(self, spans: dict) -> None:
        """{name: (lo, hi)}: where each parameter's (and buffer's) gradient sits in the payload."""
        self._overlap_spans = spans
        if self.overlap:
            self._overlap_plan = OverlapPlan(self.layout, spans, self.overlap_chunk_elems)

    def relayout(self, world_size: int) -> None:
        """The per-rank slots laid out again for `world_size` ranks (fewer: a failure shrank the
        job), in the same memory: every view of the payload stays valid."""
        if world_size == self.layout.world_size or not self.layout.rank_fields:
            return
        if self.device is not None:
            raise HpcRlxError("a bucket with a GPU twin is not laid out again after a failure")
        old, self.layout = self.layout, self.layout.for_world(world_size)
        self._set_host(self.layout.within(self.buffer, old))
        self.set_overlap_spans(self._overlap_spans)

    @property
    def overlaps(self) -> bool:
        """Overlap is on and possible: a host bucket summed by MPI's own SUM (not ordered, not
        the 16-bit wire, no GPU twin)."""
        return self._overlap_plan is not None and self.reduction.overlappable and self.device is None

    def begin_overlap(self, comm):
        """Start a step's overlap; returns the executor's ``on_grad_ready`` callback (None when
        overlap is off). The next `allreduce` finishes what this started."""
        if not self.overlaps:
            return None
        self._overlap_step = OverlapStep(self._overlap_plan, self.buffer, comm, all_finite,
                                         self.overlap_progress)
        return self._overlap_step.ready

    def payload_finite(self) -> bool:
        """Whether every payload value is finite, checked where the newest payload lives."""
        if self._overlap_step is not None:
            return self._overlap_step.payload_finite()
        if self.device_is_newest:
            xp = backend.array_module(self.device_payload)
            with backend.use_device(self.device):
                return bool(xp.isfinite(self.device_payload).all())
        return all_finite(self.payload)

    # ---- the collective -------------------------------------------------------------------
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
        if step is not None:
            self.last_chunks = step.finish(seq)
            self.last_wire_bytes = ring_bytes(comm, self.buffer.nbytes)    # MPI's Allreduce: computed
            self.last_path = "host, overlapped"
            span_t0 = min(t0, step.t_first or t0)   # the span starts with the first chunk, in backward
        else:
            done = (self.reduction if reduction is None else reduction).run(self, comm, seq)
            self.last_chunks = done.chunks
            self.last_wire_bytes = done.wire_bytes
            self.last_path = done.path
        self.sent.add(self.last_wire_bytes)
        t1 = time.perf_counter()
        if tr is not None:
            tr.add("allreduce", "comm", trace.MAIN, span_t0, t1, {"seq": seq, "bytes": int(self.buffer.nbytes),
                                                             "chunks": self.last_chunks, "path": self.last_path})
        return t1 - t0


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
