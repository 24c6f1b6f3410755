"""How the fused bucket is summed over ranks: one class per path, chosen once at start-up.

| class           | registry name (`comm.reduction`) | what one Allreduce does            |
|-----------------|----------------------------------|------------------------------------|
| `HostSum`       | `host` (auto: the default)        | in-place MPI SUM, chunk by chunk   |
| `OrderedSum`    | `ordered` (auto: ``comm.deterministic=true``) | per chunk: Gather to rank 0, add in rank order, Bcast (bitwise reproducible) |
| `WireSum`       | `wire` (auto: ``comm.wire_dtype`` set) | a reduce-scatter + allgather of a codec's 16-bit words, float32 sums at segment owners (`hpc_rlx.comm.codec`) |
| `StagedSum`     | (placement) GPU-only lanes, MPI not CUDA-aware, or a path that sums host memory | payload down to pinned host memory, then one of the above |
| `CudaDirectSum` | (placement) GPU-only lanes, CUDA-aware MPI, a path that sums device memory | Allreduce on the device buffer itself |
| `NodeSharedSum` | (``comm.shared_memory``: CPU lanes, > 1 rank per node) | each rank sums its part of the node's shared window, MPI across nodes (`hpc_rlx.comm.node_memory`) |

`registry.make_reduction` builds one from the settings (`comm.reduction`, `comm.deterministic`,
`comm.wire_dtype`) and the lanes' `cuda_mpi.PathChoice`; `path_choice.choose_reduction` picks
the bucket's path again whenever its memory or the world changes (`NodeSharedSum` once
`FusedBucket.share_node_memory` put the bucket in the node's window). Every path cuts the bucket into chunks of at most ``comm.bucket_cap_mb``: MPICH slows down sharply on
single messages above 32 MiB.

A path's ``run(bucket, comm, seq)`` returns a `Reduced`: chunks, bytes this rank sent, and the
path's name as logged and traced. What a path can do it declares (`ReductionPath`: its registry
name, overlappable, in the node's memory, exact, ordered, on the device, with a codec); the
bucket and the registry read those, never the path's class. A path is built from a `Request`
(`ReductionPath.build`). A path's ``bucket`` is the bucket's memory (`bucket_memory.BucketMemory`,
or a fragment's staging, `fragment_sync.StagedFragment`): paths touch only its arrays and its
explicit transfer methods (`payload_to_host`, `tail_to_device`, `tail_to_host`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hpc_rlx.comm.codec import Codec
from hpc_rlx.base.even_split import segments
from hpc_rlx.comm.wire_volume import allreduce_bytes
from hpc_rlx.base import backend, cuda_mpi
from hpc_rlx.base import trace


def mpi_module():
    """mpi4py's MPI module, imported on first use: importing it initialises MPI, which a
    process that only builds a bucket (tests, the doctor's config checks) must not do."""
    from mpi4py import MPI
    return MPI




@dataclass(frozen=True)
class Reduced:
    """What one Allreduce of the bucket did."""

    chunks: int
    wire_bytes: int     # bytes this rank sent (a reduce-scatter + allgather for the MPI SUM)
    path: str           # "host", "staged", "cuda-aware", "host, wire float16", ...


@dataclass(frozen=True)
class Request:
    """What a path is built for: the chunk size, the array it sums (``where``: `cuda_mpi.HOST`
    for a host bucket, STAGED for the host side of a device twin, DIRECT for the device
    buffer itself), whether the run needs a fixed order (``comm.deterministic``) and the
    16-bit codec of ``comm.wire_dtype`` (None: none); under ``comm.shard=optimizer``, for a
    path that `gathers_params`, this rank's slice (``shard``, a `shard.ParamShard`) and the
    node's one parameter array (``shared_params``, ``comm.node_shared_params``; None: none)."""

    chunk_elems: int
    where: str = cuda_mpi.HOST
    deterministic: bool = False
    codec: Codec | None = None
    shard: Any = None
    shared_params: Any = None


def chunk_bounds(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    """``[0, n)`` in pieces of at most ``chunk_elems`` (one empty piece when n == 0)."""
    return [(lo, min(n, lo + chunk_elems)) for lo in range(0, n, chunk_elems)] or [(0, 0)]


def ring_bytes(comm, nbytes: int) -> int:
    """Bytes one rank sends in MPI's Allreduce of ``nbytes``: not counted (MPI moves them) but
    computed as a ring's (reduce-scatter + allgather) volume, 2 (N - 1) / N of the message
    (`wire_volume.allreduce_bytes`); comparable with the wire path's count."""
    return allreduce_bytes(nbytes, comm.size)


# ---- what a path can do ----------------------------------------------------------------------

class ReductionPath:
    """What every path declares, so the bucket and the registry ask a path what it can do
    instead of checking its class:

    - ``name``: its name in `registry.REDUCTIONS` (``comm.reduction=NAME``); "" for the
      placements and the node's shared window, which the settings do not name;
    - ``overlappable``: MPI's own in-place SUM of the host buffer, chunk by chunk, so chunks
      may start while backward still runs (`comm.overlap`) and the node's shared window may
      take its place (`comm.shared_memory`);
    - ``in_node_memory``: the path owns the bucket's memory (the node's shared window): the
      bucket keeps it across lane placement, hands it to exact uses, and frees it (`free`);
    - ``exact``: the sum of the values as they are (no 16-bit wire);
    - ``ordered``: the additions happen in a fixed order, so a run repeats bitwise for a given
      world size (what ``comm.deterministic=true`` needs);
    - ``sums_on_device``: `sum_array` sums a device array in place (CUDA-aware MPI); a path without
      it sums a device bucket's host side (staged);
    - ``takes_codec``: it can carry the payload in a 16-bit codec (``comm.wire_dtype``);
      ``needs_codec``: only with one;
    - ``gathers_params``: a path for ``comm.shard=optimizer``: it sums only this rank's slice
      of the payload (the `Request`'s ``shard``) and gathers the parameters back after the
      step, its own way, by its method ``gather_params(comm, params)``, which returns the bytes
      sent; ``comm.reduction`` may name such a path only under ``comm.shard=optimizer``;
    - ``keeps_state_by_index``: it keeps state per payload index (the outer wire's error
      feedback), so a sum of a slice of the payload (a fragment) first sets ``offset``, where
      the slice starts.
    """

    name = ""
    overlappable = False
    in_node_memory = False
    communicators: tuple = ()     # communicators of its own (a dead rank may show there first)
    exact = True
    ordered = False
    sums_on_device = False
    takes_codec = False
    needs_codec = False
    gathers_params = False
    keeps_state_by_index = False
    path = cuda_mpi.HOST

    @classmethod
    def build(cls, request: Request) -> ReductionPath:
        """The path for ``request`` (called by `registry.make_reduction`)."""
        raise NotImplementedError(f"{cls.__name__} is not built from the settings")

    def run(self, bucket, comm, seq: int) -> Reduced:
        raise NotImplementedError

    def gather_params(self, comm, params) -> int:
        """Every rank's updated slice of `params` to every rank, in place; the bytes sent
        (only a path that ``gathers_params``)."""
        raise NotImplementedError(f"{type(self).__name__} does not gather parameters")


# ---- sums on whole arrays, in chunks ----------------------------------------------------------

class ChunkedSum(ReductionPath):
    """Sum one array (host or device) over all ranks in place, chunk by chunk.
    Subclasses say how one chunk is summed (`sum_chunk`)."""

    def __init__(self, chunk_elems: int, path: str = cuda_mpi.HOST):
        self.chunk_elems = int(chunk_elems)
        self.path = path

    @classmethod
    def build(cls, request: Request) -> ChunkedSum:
        return cls(request.chunk_elems, request.where)

    def sum_chunk(self, comm, part) -> None:
        raise NotImplementedError

    def sum_array(self, comm, array, seq: int) -> Reduced:
        size = array.shape[0]
        tracer = trace.ACTIVE if size > self.chunk_elems else None   # one chunk: the span is the chunk
        chunks = 0
        for lo in range(0, size, self.chunk_elems):
            part = array[lo: lo + self.chunk_elems]
            started = time.perf_counter()
            self.sum_chunk(comm, part)
            if tracer is not None:
                tracer.add("chunk", "comm", trace.MAIN, started, time.perf_counter(),
                           {"seq": seq, "i": chunks, "bytes": int(part.nbytes)})
            chunks += 1
        return Reduced(chunks, ring_bytes(comm, array.nbytes), self.path)

    def run(self, bucket, comm, seq: int) -> Reduced:
        return self.sum_array(comm, bucket.buffer, seq)


class HostSum(ChunkedSum):
    """MPI's own SUM Allreduce, in place (the order of additions is MPI's)."""

    name = "host"
    overlappable = True
    sums_on_device = True

    def sum_chunk(self, comm, part) -> None:
        mpi = mpi_module()
        comm.Allreduce(mpi.IN_PLACE, part, op=mpi.SUM)


class OrderedSum(ChunkedSum):
    """Rank 0 adds every rank's chunk in rank order and broadcasts the sum: bitwise
    reproducible for a given world size (``comm.deterministic=true``). Its bytes on the wire
    are reported as a ring's (`ring_bytes`): a Gather and a tree Bcast also send 2 (N - 1)
    messages of the chunk in all, but rank 0 sends more of them than the others."""

    name = "ordered"
    ordered = True

    def sum_chunk(self, comm, part) -> None:
        gathered = np.empty((comm.size,) + part.shape, dtype=part.dtype) if comm.rank == 0 else None
        comm.Gather(np.ascontiguousarray(part), gathered, root=0)
        if comm.rank == 0:
            total = gathered[0].copy()
            for src in range(1, comm.size):
                total += gathered[src]
            part[...] = total
        comm.Bcast(part, root=0)


# ---- the 16-bit wire -----------------------------------------------------------------------

class WireSum(ReductionPath):
    """A reduce-scatter + allgather of the payload in a codec's 16-bit words (`codec.Codec`),
    the tail as raw bits summed exactly by rank 0: bitwise identical on every rank.

    Per chunk, each rank owns one segment. Every rank codes its slice of each owner's segment
    and sends it there (Alltoallv); each owner lets the codec add the slices in float32 in
    rank order, codes the sum once and sends it to everyone (Allgatherv). The tail rides in
    the last chunk, behind rank 0's segment. On one rank there is nothing to send:
    `single_rank` sums."""

    name = "wire"
    exact = False
    ordered = True
    takes_codec = needs_codec = True

    def __init__(self, codec: Codec, chunk_elems: int, single_rank: ChunkedSum, where: str):
        self.codec = codec
        self.chunk_elems = int(chunk_elems)
        self.single_rank = single_rank
        self.path = f"{where}, wire {codec.name}"

    @classmethod
    def build(cls, request: Request) -> WireSum:
        plain = replace(request, codec=None)
        single_rank = (OrderedSum if request.deterministic else HostSum).build(plain)
        return cls(request.codec, request.chunk_elems, single_rank, request.where)

    def run(self, bucket, comm, seq: int) -> Reduced:
        if comm.size == 1:
            return self.single_rank.run(bucket, comm, seq)
        payload = bucket.payload
        tail_words = np.ascontiguousarray(bucket.tail).view(np.uint16)
        pieces = chunk_bounds(bucket.payload_size, self.chunk_elems)
        sent = 0
        tracer = trace.ACTIVE
        for index, (lo, hi) in enumerate(pieces):
            started = time.perf_counter()
            is_last = index == len(pieces) - 1
            outgoing_bytes, sent_now = self._sum_chunk(comm, payload, lo, hi,
                                                       bucket.tail if is_last else None,
                                                       tail_words if is_last else None)
            sent += sent_now
            if tracer is not None:
                tracer.add("chunk", "comm", trace.MAIN, started, time.perf_counter(),
                           {"seq": seq, "i": index, "bytes": outgoing_bytes, "wire": self.codec.name})
        return Reduced(len(pieces), int(sent), self.path)

    # ---- the two codings, where a subclass may keep what they lose (`FeedbackWireSum`) ----------
    def code_input(self, payload, a: int, b: int, out) -> None:
        """Code this rank's ``payload[a:b]`` for the segment's owner into ``out``."""
        self.codec.encode(payload[a:b], out)

    def code_sum(self, total, a: int, b: int, out) -> None:
        """Code the owner's float32 sum of segment ``[a, b)`` into ``out``."""
        self.codec.encode(total, out)

    def _sum_chunk(self, comm, payload, lo: int, hi: int, tail, tail_words) -> tuple[int, int]:
        """Sum ``payload[lo:hi]`` (and the tail, when given) over all ranks in place.
        Returns (bytes of this rank's outgoing words, bytes that left this rank)."""
        ranks, me, codec, words16 = comm.size, comm.rank, self.codec, mpi_module().UINT16_T
        owned = [(lo + a, lo + b) for a, b in segments(hi - lo, ranks)]   # segment of each owner
        body_words = [codec.words(b - a) for a, b in owned]
        words = list(body_words)                # per owner, with the tail behind owner 0's block
        if tail_words is not None:
            words[0] += tail_words.shape[0]
        offsets = np.concatenate([[0], np.cumsum(words[:-1])]).astype(int).tolist()

        outgoing = np.empty(sum(words), np.uint16)
        for owner, (a, b) in enumerate(owned):
            start = offsets[owner]
            self.code_input(payload, a, b, outgoing[start: start + body_words[owner]])
        if tail_words is not None:
            outgoing[offsets[0] + body_words[0]: offsets[0] + words[0]] = tail_words

        # every rank's slice of my segment, one after the other in rank order
        mine = words[me]
        incoming = np.empty(mine * ranks, np.uint16)
        comm.Alltoallv([outgoing, (words, offsets), words16],
                       [incoming, ([mine] * ranks, [mine * src for src in range(ranks)]), words16])
        a, b = owned[me]
        my_body = body_words[me]
        total = codec.sum_blocks((incoming[src * mine: src * mine + my_body] for src in range(ranks)), b - a)
        summed = np.empty(mine, np.uint16)
        self.code_sum(total, a, b, summed[:my_body])
        if tail is not None and me == 0:
            tail_total = np.zeros(tail.shape[0], tail.dtype)
            for src in range(ranks):
                tail_total += incoming[src * mine + my_body: (src + 1) * mine].view(tail.dtype)
            summed[my_body:] = tail_total.view(np.uint16)

        gathered = np.empty(sum(words), np.uint16)
        comm.Allgatherv([summed, words16], [gathered, (words, offsets), words16])
        for owner, (a, b) in enumerate(owned):
            start = offsets[owner]
            payload[a:b] = codec.decode(gathered[start: start + body_words[owner]], b - a)
        if tail is not None:
            tail[...] = gathered[offsets[0] + body_words[0]: offsets[0] + words[0]].view(tail.dtype)
        # what left this rank: its slices for the other owners, and its sum for the others
        return int(outgoing.nbytes), (outgoing.nbytes - mine * 2) + summed.nbytes * (ranks - 1)


# ---- a bucket with a twin on the GPU: where a path sums it (placements) ---------------------

class StagedSum(ReductionPath):
    """The payload comes down to the bucket's page-locked host array (async copy + one sync),
    then `inner` sums on the host; the host array is the result (the optimizer is there)."""

    def __init__(self, inner):
        self.inner = inner
        self.path = inner.path
        self.name, self.exact, self.ordered = inner.name, inner.exact, inner.ordered
        self.gathers_params = inner.gathers_params      # the parameters stay on the host

    def run(self, bucket, comm, seq: int) -> Reduced:
        bucket.payload_to_host()
        return self.inner.run(bucket, comm, seq)

    def gather_params(self, comm, params) -> int:
        return self.inner.gather_params(comm, params)


class CudaDirectSum(ReductionPath):
    """CUDA-aware MPI: the tail goes up, the device is synchronised (MPI does not wait for
    queued kernels), `on_device` sums the device buffer, the small tail comes down; the payload
    stays on the device until someone calls `payload_to_host`. When the host already holds
    the newest payload (someone wrote into it), `on_host` sums the host array instead."""

    path = cuda_mpi.DIRECT

    def __init__(self, on_device: ChunkedSum, on_host: ReductionPath):
        self.on_device, self.on_host = on_device, on_host
        self.name, self.exact, self.ordered = on_device.name, on_device.exact, on_device.ordered

    def run(self, bucket, comm, seq: int) -> Reduced:
        if not bucket.device_is_newest:
            return self.on_host.run(bucket, comm, seq)
        bucket.tail_to_device()
        backend.synchronize_device(bucket.device)
        done = self.on_device.sum_array(comm, bucket.device_buffer, seq)
        bucket.tail_to_host()
        bucket.mark_device_fresh()
        return done
