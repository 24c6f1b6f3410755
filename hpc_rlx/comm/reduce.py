"""How the fused bucket is summed over ranks: one class per path, chosen once at start-up.

| class           | used when                                             | what one Allreduce does            |
|-----------------|-------------------------------------------------------|------------------------------------|
| `HostSum`       | the bucket is a host array (the default)              | in-place MPI SUM, chunk by chunk   |
| `OrderedSum`    | ``comm.deterministic=true``                           | per chunk: Gather to rank 0, add in rank order, Bcast (bitwise reproducible) |
| `WireSum`       | ``comm.wire_dtype`` set and more than one rank        | 16-bit words, float32 sums at segment owners (see `hpc_rlx.comm.wire`) |
| `StagedSum`     | GPU-only lanes, MPI not CUDA-aware (or ordered, wire) | payload down to pinned host memory, then one of the above |
| `CudaDirectSum` | GPU-only lanes, CUDA-aware MPI                        | Allreduce on the device buffer itself |
| `NodeSharedSum` | ``comm.shared_memory`` (CPU lanes, > 1 rank per node) | each rank sums its part of the node's shared window, MPI across nodes (`hpc_rlx.comm.node_memory`) |

`make_reduction` picks one from the settings and the lanes' `cuda_mpi.PathChoice`; the bucket
keeps it for the whole run (`FusedBucket.share_node_memory` swaps in `NodeSharedSum` before the
lanes are built). Every path cuts the bucket into chunks of at most
``comm.bucket_cap_mb``: MPICH slows down sharply on single messages above 32 MiB.

A path's ``run(bucket, comm, seq)`` returns a `Reduced`: chunks, bytes this rank sent, and the
path's name as logged and traced. What a path can do it declares (`ReductionPath`: overlappable,
in the node's memory, exact); the bucket reads those, never the path's class. Paths touch the bucket only through its arrays and its
explicit transfer methods (`payload_to_host`, `tail_to_device`, `tail_to_host`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hpc_rlx.comm.wire import block_words, pack_block, segments, unpack_block
from hpc_rlx.device import backend, cuda_mpi
from hpc_rlx.observe import trace


def _mpi():
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


def chunk_bounds(n: int, chunk_elems: int) -> list[tuple[int, int]]:
    """``[0, n)`` in pieces of at most ``chunk_elems`` (one empty piece when n == 0)."""
    return [(lo, min(n, lo + chunk_elems)) for lo in range(0, n, chunk_elems)] or [(0, 0)]


def ring_bytes(comm, nbytes: int) -> int:
    """Bytes one rank sends in a reduce-scatter + allgather of ``nbytes``: comparable with
    the wire path's count."""
    return int(2 * (comm.size - 1) * nbytes // max(1, comm.size))


# ---- what a path can do ----------------------------------------------------------------------

class ReductionPath:
    """What every path declares, so the bucket asks a path what it can do instead of checking
    its class:

    - ``overlappable``: MPI's own in-place SUM of the host buffer, chunk by chunk, so chunks
      may start while backward still runs (`comm.overlap`) and the node's shared window may
      take its place (`comm.shared_memory`);
    - ``in_node_memory``: the path owns the bucket's memory (the node's shared window): the
      bucket keeps it across lane placement, hands it to exact uses, and frees it (`free`);
    - ``exact``: the sum of the values as they are (no 16-bit wire).
    """

    overlappable = False
    in_node_memory = False
    exact = True
    path = cuda_mpi.HOST

    def run(self, bucket, comm, seq: int) -> Reduced:
        raise NotImplementedError


# ---- sums on whole arrays, in chunks ----------------------------------------------------------

class ChunkedSum(ReductionPath):
    """Sum one array (host or device) over all ranks in place, chunk by chunk.
    Subclasses say how one chunk is summed (`sum_chunk`)."""

    def __init__(self, chunk_elems: int, path: str = cuda_mpi.HOST):
        self.chunk_elems = int(chunk_elems)
        self.path = path

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

    overlappable = True

    def sum_chunk(self, comm, part) -> None:
        mpi = _mpi()
        comm.Allreduce(mpi.IN_PLACE, part, op=mpi.SUM)


class OrderedSum(ChunkedSum):
    """Rank 0 adds every rank's chunk in rank order and broadcasts the sum: bitwise
    reproducible for a given world size (``comm.deterministic=true``)."""

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
    """The payload as 16-bit words with float32 sums at segment owners, the tail as raw bits
    summed exactly by rank 0 (see `hpc_rlx.comm.wire`): bitwise identical on every rank.

    Per chunk, each rank owns one segment. Every rank codes its slice of each owner's segment
    and sends it there (Alltoallv); each owner decodes the slices, adds them in float32 in rank
    order, codes the sum once and sends it to everyone (Allgatherv). The tail rides in the last
    chunk, behind rank 0's segment. On one rank there is nothing to send: `single_rank` sums."""

    exact = False

    def __init__(self, codec: str, chunk_elems: int, single_rank: ChunkedSum, where: str):
        self.codec = codec
        self.chunk_elems = int(chunk_elems)
        self.single_rank = single_rank
        self.path = f"{where}, wire {codec}"

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
                           {"seq": seq, "i": index, "bytes": outgoing_bytes, "wire": self.codec})
        return Reduced(len(pieces), int(sent), self.path)

    def _sum_chunk(self, comm, payload, lo: int, hi: int, tail, tail_words) -> tuple[int, int]:
        """Sum ``payload[lo:hi]`` (and the tail, when given) over all ranks in place.
        Returns (bytes of this rank's outgoing words, bytes that left this rank)."""
        ranks, me, codec, words16 = comm.size, comm.rank, self.codec, _mpi().UINT16_T
        owned = [(lo + a, lo + b) for a, b in segments(hi - lo, ranks)]   # segment of each owner
        body_words = [block_words(b - a) for a, b in owned]
        words = list(body_words)                # per owner, with the tail behind owner 0's block
        if tail_words is not None:
            words[0] += tail_words.shape[0]
        offsets = np.concatenate([[0], np.cumsum(words[:-1])]).astype(int).tolist()

        outgoing = np.empty(sum(words), np.uint16)
        for owner, (a, b) in enumerate(owned):
            start = offsets[owner]
            pack_block(payload[a:b], codec, outgoing[start: start + body_words[owner]])
        if tail_words is not None:
            outgoing[offsets[0] + body_words[0]: offsets[0] + words[0]] = tail_words

        # every rank's slice of my segment, one after the other in rank order
        mine = words[me]
        incoming = np.empty(mine * ranks, np.uint16)
        comm.Alltoallv([outgoing, (words, offsets), words16],
                       [incoming, ([mine] * ranks, [mine * src for src in range(ranks)]), words16])
        a, b = owned[me]
        my_body = body_words[me]
        total = np.zeros(b - a, np.float32)
        for src in range(ranks):                # rank order: reproducible sums
            total += unpack_block(incoming[src * mine: src * mine + my_body], codec)
        summed = np.empty(mine, np.uint16)
        pack_block(total, codec, summed[:my_body])
        if tail is not None and me == 0:
            tail_total = np.zeros(tail.shape[0], tail.dtype)
            for src in range(ranks):
                tail_total += incoming[src * mine + my_body: (src + 1) * mine].view(tail.dtype)
            summed[my_body:] = tail_total.view(np.uint16)

        gathered = np.empty(sum(words), np.uint16)
        comm.Allgatherv([summed, words16], [gathered, (words, offsets), words16])
        for owner, (a, b) in enumerate(owned):
            start = offsets[owner]
            payload[a:b] = unpack_block(gathered[start: start + body_words[owner]], codec)
        if tail is not None:
            tail[...] = gathered[offsets[0] + body_words[0]: offsets[0] + words[0]].view(tail.dtype)
        # what left this rank: its slices for the other owners, and its sum for the others
        return int(outgoing.nbytes), (outgoing.nbytes - mine * 2) + summed.nbytes * (ranks - 1)


# ---- a bucket with a twin on the GPU -------------------------------------------------------

class StagedSum(ReductionPath):
    """The payload comes down to the bucket's page-locked host array (async copy + one sync),
    then `inner` sums on the host; the host array is the result (the optimizer is there)."""

    def __init__(self, inner):
        self.inner = inner
        self.path = inner.path
        self.exact = inner.exact

    def run(self, bucket, comm, seq: int) -> Reduced:
        bucket.payload_to_host()
        return self.inner.run(bucket, comm, seq)


class CudaDirectSum(ReductionPath):
    """CUDA-aware MPI: the tail goes up, the device is synchronised (MPI does not wait for
    queued kernels), MPI sums the device buffer, the small tail comes down; the payload
    stays on the device until someone calls `payload_to_host`. When the host already holds
    the newest payload (someone wrote into it), the host array is summed instead."""

    path = cuda_mpi.DIRECT

    def __init__(self, chunk_elems: int):
        self.on_device = HostSum(chunk_elems, cuda_mpi.DIRECT)
        self.on_host = HostSum(chunk_elems, cuda_mpi.STAGED)

    def run(self, bucket, comm, seq: int) -> Reduced:
        if not bucket.device_is_newest:
            return self.on_host.run(bucket, comm, seq)
        bucket.tail_to_device()
        backend.synchronize_device(bucket.device)
        done = self.on_device.sum_array(comm, bucket.device_buffer, seq)
        bucket.tail_to_host()
        bucket.mark_device_fresh()
        return done


def make_reduction(chunk_elems: int, deterministic: bool, wire: str | None,
                   choice: cuda_mpi.PathChoice | None = None):
    """The bucket's reduction path for this rank's settings and lane placement (``choice``:
    None or HOST for a host bucket, STAGED or DIRECT for a bucket with a device twin)."""
    path = choice.path if choice is not None else cuda_mpi.HOST
    if path == cuda_mpi.DIRECT:
        return CudaDirectSum(chunk_elems)
    where = cuda_mpi.STAGED if path == cuda_mpi.STAGED else cuda_mpi.HOST
    host_sum = (OrderedSum if deterministic else HostSum)(chunk_elems, where)
    reduction = WireSum(wire, chunk_elems, host_sum, where) if wire else host_sum
    return StagedSum(reduction) if path == cuda_mpi.STAGED else reduction
