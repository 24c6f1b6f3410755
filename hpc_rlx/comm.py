"""Everything MPI: collective error agreement, spec/array broadcast, the fused bucket and abort.

Idioms: lowercase `bcast`/`allgather` only for small Python objects (the spec, status
strings); uppercase buffer collectives for arrays, so arrays are never pickled.
"""

from __future__ import annotations

import functools
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

from . import trace
from . import watchdog as _watchdog
from .errors import HpcRlxError
from .job_abort import abort_job
from .topology import hostname, rank_span


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
    """Run one collective under the stall watchdog (`hpc_rlx.watchdog`): it only notes
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
    statuses = watched_call("error agreement (allgather)", comm.allgather, _status(exc))
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
    payload = watched_call(f"broadcast of rank {root}'s result", comm.bcast, payload, root=root)
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

_FINITE_BLOCK = 1 << 16


def _all_finite(x: np.ndarray) -> bool:
    """``np.isfinite(x).all()`` in cache-sized blocks into one small mask: no temporary as
    large as the gradient each step, and it stops at the first bad block."""
    flat = x.reshape(-1)
    mask = np.empty(min(flat.size, _FINITE_BLOCK), dtype=bool)
    for lo in range(0, flat.size, _FINITE_BLOCK):
        part = flat[lo: lo + _FINITE_BLOCK]
        view = mask[: part.size]
        np.isfinite(part, out=view)
        if not view.all():
            return False
    return True


class FusedBucket:
    """One contiguous array: [gradients or weighted params ... | tail fields].

    Lanes write gradients straight into `payload` views, the loop writes counts, loss sums
    and flags into the tail, and one in-place SUM Allreduce (chunked under the size cap)
    gives every rank the global sums of all of it at once.

    On a rank whose lanes are all GPUs the bucket also has a twin on the lead GPU
    (`attach_device`): the lanes sum their gradients there, and the payload comes to the
    (page-locked) host array only when something reads `payload`, or through the Allreduce:
    - cuda-aware: the tail goes up, the stream is synchronised and the Allreduce runs on the
      CuPy buffer itself; the reduced payload comes down when the optimizer reads it;
    - staged: the payload comes down to the pinned host buffer (async copy + one sync), the
      Allreduce runs there, and the host array is the result (the optimizer is on the host).
    The tail always lives on the host and is never compressed.

    `wire_dtype` (bfloat16 | float16) sends the payload as 16-bit words with float32 sums
    (see `hpc_rlx.wire`): half the bytes, off by default.
    """

    def __init__(self, payload_size: int, tail_fields: Sequence[str], dtype, xp=np,
                 cap_mb: float = 16.0, deterministic: bool = False, wire_dtype: str | None = None):
        from .wire import normalize_wire

        self.fields = {name: i for i, name in enumerate(tail_fields)}
        self.payload_size = int(payload_size)
        self._set_host(xp.zeros(self.payload_size + len(tail_fields), dtype=dtype))
        itemsize = np.dtype(dtype).itemsize
        self.chunk_elems = max(1, int(cap_mb * 1024 * 1024) // itemsize)
        self.deterministic = deterministic
        self.wire = normalize_wire(wire_dtype)
        self.last_chunks = 0
        self.last_wire_bytes = 0        # bytes this rank sent in the last allreduce
        self.last_path = "host"
        self.device = None              # lead GPU of the device twin, if any
        self.device_buffer = None
        self.device_payload = None
        self.choice = None              # cuda_mpi.PathChoice once lanes placed the bucket
        self._device_fresh = False      # the newest payload is on the device

    def _set_host(self, buf) -> None:
        self._buffer = buf
        self._payload = buf[: self.payload_size]
        self.tail = buf[self.payload_size:]

    # ---- views: reading the payload brings a device-side result down first -------------
    @property
    def buffer(self):
        self.pull_payload()
        return self._buffer

    @property
    def payload(self):
        self.pull_payload()
        return self._payload

    @payload.setter
    def payload(self, value) -> None:
        # only `bucket.payload op= x`, which assigns the same (updated in place) array back
        if value is not self._payload:
            raise AttributeError("FusedBucket.payload is a view of the bucket: write into it "
                                 "(bucket.payload[...] = x), do not rebind it")

    def __getitem__(self, field: str) -> float:
        return float(self.tail[self.fields[field]])

    def __setitem__(self, field: str, value: float) -> None:
        self.tail[self.fields[field]] = value

    def zero_tail(self) -> None:
        self.tail[...] = 0

    # ---- the device twin ----------------------------------------------------------------
    def attach_device(self, device: int, choice) -> None:
        """Give the bucket a twin on GPU `device` and move the host side to page-locked
        memory. Call before anyone keeps a view of `payload` or `buffer`."""
        from . import backend

        host = backend.pinned_empty(self._buffer.shape[0], self._buffer.dtype)
        host[...] = self._buffer
        self._set_host(host)
        self.device = int(device)
        self.device_buffer = backend.device_zeros(host.shape[0], host.dtype, self.device)
        self.device_payload = self.device_buffer[: self.payload_size]
        self._device_tail = self.device_buffer[self.payload_size:]
        self.choice = choice
        self._device_fresh = False

    def set_choice(self, choice) -> None:
        self.choice = choice

    def describe(self) -> str:
        """Where the bucket lives and how it is reduced, in one line (logged at start-up)."""
        where = "host" if self.device is None else f"GPU {self.device}"
        path = self.choice.describe() if self.choice is not None else "host"
        wire = f", wire {self.wire} (float32 sums; tail uncompressed)" if self.wire else ""
        return f"bucket on {where}, path {path}{wire}"

    def mark_device_fresh(self) -> None:
        """The lanes left the newest payload in `device_payload`."""
        if self.device_buffer is None:
            raise HpcRlxError("mark_device_fresh on a bucket without a device twin")
        self._device_fresh = True

    def pull_payload(self) -> None:
        """Bring a device-side payload down to the host array (no-op when the host is newest)."""
        if self._device_fresh:
            from . import backend
            backend.copy_to_host(self._payload, self.device_payload)
            self._device_fresh = False

    def payload_finite(self) -> bool:
        """Whether every payload value is finite, checked where the newest payload lives."""
        if self._device_fresh:
            from . import backend
            xp = backend.array_module(self.device_payload)
            with backend.use_device(self.device):
                return bool(xp.isfinite(self.device_payload).all())
        return _all_finite(self._payload)

    # ---- the collective -------------------------------------------------------------------
    @watched("fused-bucket Allreduce")
    def allreduce(self, comm) -> float:
        """Sum the whole bucket over all ranks in place. Returns seconds spent."""
        t0 = time.perf_counter()
        tr = trace.ACTIVE
        seq = tr.next_seq() if tr is not None else 0
        if self.wire and comm.size > 1:
            self.pull_payload()
            chunks, nbytes = self._wire_allreduce(comm, tr, seq)
            self.last_path = f"staged, wire {self.wire}" if self.device is not None else f"host, wire {self.wire}"
        elif self._device_fresh and self.choice is not None and self.choice.direct:
            chunks, nbytes = self._direct_allreduce(comm, tr, seq)
            self.last_path = "cuda-aware"
        else:
            self.pull_payload()       # the staged path: down to pinned host memory first
            chunks, nbytes = self._host_allreduce(comm, self._buffer, tr, seq)
            self.last_path = "host" if self.device is None else "staged"
        self.last_chunks = chunks
        self.last_wire_bytes = nbytes
        t1 = time.perf_counter()
        if tr is not None:
            tr.add("allreduce", "comm", trace.MAIN, t0, t1,
                   {"seq": seq, "bytes": int(self._buffer.nbytes), "chunks": chunks, "path": self.last_path})
        return t1 - t0

    def _host_allreduce(self, comm, buf, tr, seq) -> tuple[int, int]:
        from mpi4py import MPI
        n = buf.shape[0]
        chunks = 0
        # one chunk: the allreduce span is the chunk (one event less per step)
        tr_chunks = tr if n > self.chunk_elems else None
        for lo in range(0, n, self.chunk_elems):
            part = buf[lo: lo + self.chunk_elems]
            tc = time.perf_counter()
            if self.deterministic:
                _ordered_sum(comm, part)
            else:
                comm.Allreduce(MPI.IN_PLACE, part, op=MPI.SUM)
            if tr_chunks is not None:
                tr_chunks.add("chunk", "comm", trace.MAIN, tc, time.perf_counter(),
                              {"seq": seq, "i": chunks, "bytes": int(part.nbytes)})
            chunks += 1
        # bytes a reduce-scatter + allgather sends per rank: comparable with the wire path's count
        return chunks, int(2 * (comm.size - 1) * buf.nbytes // max(1, comm.size))

    def _direct_allreduce(self, comm, tr, seq) -> tuple[int, int]:
        """CUDA-aware MPI: the tail goes up, then MPI reads and writes GPU memory directly."""
        from . import backend
        backend.copy_to_device(self._device_tail, self.tail)
        backend.synchronize_device(self.device)     # MPI does not wait for queued kernels
        chunks, nbytes = self._host_allreduce(comm, self.device_buffer, tr, seq)
        backend.copy_to_host(self.tail, self._device_tail)   # small; the payload comes on demand
        self._device_fresh = True
        return chunks, nbytes

    def _wire_allreduce(self, comm, tr, seq) -> tuple[int, int]:
        """Payload as 16-bit words with float32 sums at segment owners; the tail as raw bits
        summed exactly by owner 0 (see `hpc_rlx.wire`). Bitwise identical on every rank."""
        from mpi4py import MPI

        from .wire import block_words, pack_block, segments, unpack_block

        size, rank = comm.size, comm.rank
        buf, codec = self._buffer, self.wire
        tail = self.tail
        tail_words = np.ascontiguousarray(tail).view(np.uint16)
        t_words = tail_words.shape[0]
        n = self.payload_size
        bounds = [(lo, min(n, lo + self.chunk_elems)) for lo in range(0, n, self.chunk_elems)] or [(0, 0)]
        sent = 0
        for ci, (clo, chi) in enumerate(bounds):
            tc = time.perf_counter()
            last = ci == len(bounds) - 1
            segs = [(clo + a, clo + b) for a, b in segments(chi - clo, size)]
            sizes = [block_words(b - a) + (t_words if (last and k == 0) else 0) for k, (a, b) in enumerate(segs)]
            displs = [0]
            for s_ in sizes[:-1]:
                displs.append(displs[-1] + s_)
            send = np.empty(sum(sizes), np.uint16)
            for k, (a, b) in enumerate(segs):
                d = displs[k]
                pack_block(buf[a:b], codec, send[d: d + block_words(b - a)])
                if last and k == 0:
                    send[d + block_words(b - a): d + sizes[k]] = tail_words
            mine = sizes[rank]
            recv = np.empty(mine * size, np.uint16)
            comm.Alltoallv([send, (sizes, displs), MPI.UINT16_T],
                           [recv, ([mine] * size, [mine * r for r in range(size)]), MPI.UINT16_T])
            a, b = segs[rank]
            words = block_words(b - a)
            acc = np.zeros(b - a, np.float32)
            for src in range(size):                     # rank order: reproducible sums
                acc += unpack_block(recv[src * mine: src * mine + words], codec)
            out = np.empty(mine, np.uint16)
            pack_block(acc, codec, out[:words])
            if last and rank == 0:
                total = np.zeros(tail.shape[0], tail.dtype)
                for src in range(size):
                    total += recv[src * mine + words: (src + 1) * mine].view(tail.dtype)
                out[words:] = total.view(np.uint16)
            gathered = np.empty(sum(sizes), np.uint16)
            comm.Allgatherv([out, MPI.UINT16_T], [gathered, (sizes, displs), MPI.UINT16_T])
            for k, (a, b) in enumerate(segs):
                d = displs[k]
                buf[a:b] = unpack_block(gathered[d: d + block_words(b - a)], codec)
                if last and k == 0:
                    tail[...] = gathered[d + block_words(b - a): d + sizes[k]].view(tail.dtype)
            # what left this rank: its blocks for the other owners, and its sums for the others
            sent += (send.nbytes - mine * 2) + out.nbytes * (size - 1)
            if tr is not None:
                tr.add("chunk", "comm", trace.MAIN, tc, time.perf_counter(),
                       {"seq": seq, "i": ci, "bytes": int(send.nbytes), "wire": codec})
        return len(bounds), int(sent)


def _ordered_sum(comm, part: np.ndarray) -> None:
    """Sum in rank order on rank 0, then broadcast: bitwise reproducible for a world size."""
    gathered = np.empty((comm.size,) + part.shape, dtype=part.dtype) if comm.rank == 0 else None
    comm.Gather(np.ascontiguousarray(part), gathered, root=0)
    if comm.rank == 0:
        acc = gathered[0].copy()
        for r in range(1, comm.size):
            acc += gathered[r]
        part[...] = acc
    comm.Bcast(part, root=0)


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
