"""`comm.shard=optimizer`: sharded optimizer state over MPI (ZeRO stage 1).

Each rank owns one contiguous slice of the parameter vector (`ParamShard`: `base.even_split.segments`
of the whole payload, trainable parameters then buffers). Per step:

1. `ScatteredSum`, the bucket's reduction path: the tail (sample count, loss, flags) is summed
   on every rank, the payload is reduce-scattered, so each rank holds the global sum of its own
   slice only (the rest of its payload is left as it was);
2. the rank steps the optimizer on its slice, holding only that slice's state (`Worker`);
3. `ParamShard.allgather` gives every rank the updated parameters.

The reduce-scatter moves the same bytes as the first half of a ring Allreduce and the allgather
the second half. With ``comm.wire_dtype`` the reduce-scatter carries the codec's 16-bit words
(`codec.Codec`) and the owner adds them in float32; the allgather carries the parameters as
they are (every rank must step from the same values). The owner's float32 sum is bitwise the
one the unsharded wire (`reduce.WireSum`) forms, which codes it once more for the other ranks:
a sharded step differs from an unsharded one by that one 16-bit rounding of the sum
(`tests/mpi/runtime/test_sharded_state.py`). Both run in rounds of at most ``comm.bucket_cap_mb`` per rank (MPICH slows on
messages above 32 MiB). Each rank adds the slices it receives in rank order, so the sum is
bitwise the one `reduce.OrderedSum` gives (``comm.deterministic``) and repeats run to run.
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.comm.codec import Codec
from hpc_rlx.comm.reduce import ReductionPath, Reduced, Request, mpi_module
from hpc_rlx.base.even_split import segments
from hpc_rlx.comm.wire_volume import allgather_bytes
from hpc_rlx.optim.segments import cut_parameters

SHARD_CHOICES = ("none", "optimizer")


class ParamShard:
    """This rank's slice of a parameter vector of `size` values whose first `n_trainable` are
    stepped by the optimizer (the rest: buffers such as batch norm's running statistics)."""

    def __init__(self, size: int, n_trainable: int, rank: int, world: int):
        self.size, self.n_trainable, self.rank, self.world = int(size), int(n_trainable), int(rank), int(world)
        self.bounds = segments(self.size, self.world)
        self.lo, self.hi = self.bounds[self.rank]

    @property
    def trainable(self) -> slice:
        """This rank's trainable parameters (maybe empty)."""
        return slice(self.lo, max(self.lo, min(self.hi, self.n_trainable)))

    @property
    def buffers(self) -> slice:
        """This rank's buffer values (maybe empty)."""
        start = max(self.lo, self.n_trainable)
        return slice(start, max(start, self.hi))

    @property
    def n_local(self) -> int:
        """How many trainable values this rank's optimizer steps."""
        t = self.trainable
        return t.stop - t.start

    def local(self, full):
        """This rank's part of an array over the trainable parameters (optimizer state)."""
        t = self.trainable
        return full[t.start: t.stop]

    def trainable_bounds(self) -> list[tuple[int, int]]:
        """Every rank's trainable range, for gathering optimizer state."""
        return [(min(lo, self.n_trainable), min(hi, self.n_trainable)) for lo, hi in self.bounds]

    def rounds(self, chunk_elems: int) -> list[list[tuple[int, int]]]:
        """The slices cut into rounds: round r holds every rank's r-th piece, and one rank's
        receive side of a round (world pieces) stays within `chunk_elems` values."""
        longest = max(hi - lo for lo, hi in self.bounds)
        per_rank = max(1, int(chunk_elems) // self.world)      # one rank's piece of a round
        count = max(1, math.ceil(longest / per_rank))
        pieces = [[(lo + a, lo + b) for a, b in segments(hi - lo, count)] for lo, hi in self.bounds]
        return [[pieces[r][k] for r in range(self.world)] for k in range(count)]

    # ---- MPI -------------------------------------------------------------------------------
    def allgather(self, comm, params, chunk_elems: int) -> int:
        """Every rank's slice of `params` to every rank, in place (`allgather_pieces` over
        `rounds`). Returns the bytes this rank sent."""
        return allgather_pieces(comm, params, self.rounds(chunk_elems))

    def gather_to_root(self, comm, local: np.ndarray) -> np.ndarray | None:
        """Rank 0: the whole trainable-sized array of which every rank holds its part (one
        rank's part at a time arrives into the result); the other ranks: None."""
        bounds = self.trainable_bounds()
        counts = [hi - lo for lo, hi in bounds]
        full = np.empty(self.n_trainable, dtype=local.dtype) if self.rank == 0 else None
        comm.Gatherv(np.ascontiguousarray(local), [full, (counts, [lo for lo, _ in bounds])] if self.rank == 0
                     else None, root=0)
        return full


class SplitNorms:
    """The per-parameter squared norms an optimizer computes on its slice (LAMB's and LARS's
    trust ratios, `Optimizer.segment_norms`), completed for the parameters a slice boundary
    cuts: their parts, from the ranks that hold them, added in rank order. The cut parameters
    follow from the slices alone, so every rank knows them; there are at most world - 1, and
    none: no collective. Allgather and an ordered sum rather than MPI's Allreduce: every rank
    gets the same bits whatever the MPI's reduction order."""

    def __init__(self, comm, spans, shard: ParamShard, segments):
        self.comm = comm
        starts = [lo for lo, _ in shard.trainable_bounds()[1:]]
        self.cut = cut_parameters(spans, starts)
        where = {index: k for k, index in enumerate(self.cut)}
        # (row of the optimizer's segments, row of the exchanged array) of this rank's cut parts
        self.rows = [(i, where[s.index]) for i, s in enumerate(segments) if s.index in where]

    def __call__(self, partial: np.ndarray) -> np.ndarray:
        if not self.cut:
            return partial
        mine = np.zeros((len(self.cut), partial.shape[1]))
        for i, k in self.rows:
            mine[k] = partial[i]
        every = np.empty((self.comm.size,) + mine.shape)
        self.comm.Allgather(mine, every)
        total = every[0].copy()
        for src in range(1, self.comm.size):
            total += every[src]
        out = partial.copy()
        for i, k in self.rows:
            out[i] = total[k]
        return out


def allgather_pieces(comm, params, rounds: list[list[tuple[int, int]]]) -> int:
    """Round r's piece ``rounds[r][k]`` of `params`, held by rank k of `comm`, to every rank,
    in place. Each round is one MPI Allgather of equal blocks (the pieces padded to the longest)
    through a scratch buffer: MPICH's in-place Allgatherv of the same pieces, spread over the
    vector, took 10-20x as long here (25 against 1.3 ms on 2 ranks, bench/README.md's
    bench_shard section). Returns the bytes this rank sent: MPI moves them, so they are
    computed as a ring Allgather's, (N - 1) padded blocks per round (`wire_volume.allgather_bytes`)."""
    block = max(hi - lo for pieces in rounds for lo, hi in pieces)
    send = np.empty(block, dtype=params.dtype)
    recv = np.empty(block * comm.size, dtype=params.dtype)
    for pieces in rounds:
        lo, hi = pieces[comm.rank]
        send[:hi - lo] = params[lo:hi]
        comm.Allgather(send, recv)
        for r, (lo, hi) in enumerate(pieces):
            if r != comm.rank:
                params[lo:hi] = recv[r * block: r * block + hi - lo]
    return len(rounds) * allgather_bytes(send.nbytes, comm.size)


class ScatteredSum(ReductionPath):
    """The fused bucket reduce-scattered (`comm.shard=optimizer`): the tail summed on every
    rank, the payload summed only in this rank's slice (`ParamShard`), by one Alltoallv per
    round and additions in rank order. It gathers the parameters back (`gather_params`): MPI's
    rounds (`ParamShard.allgather`), or, with ``comm.node_shared_params``, the node's one array
    (`node_params.NodeSharedParams`: only other nodes' slices travel). A path that
    ``comm.reduction`` names under ``comm.shard=optimizer`` may subclass it (`build` passes
    the `Request`'s shard) and gather its own way."""

    exact = True
    ordered = True
    takes_codec = True
    gathers_params = True

    def __init__(self, shard: ParamShard, chunk_elems: int, codec: Codec | None = None, shared_params=None):
        self.shard = shard
        self.codec = codec                  # comm.wire_dtype: the payload travels coded
        self.exact = codec is None
        self.chunk_elems = int(chunk_elems)
        self.shared_params = shared_params  # comm.node_shared_params: the node's parameter array
        self._rounds = None
        self._scratch = None

    @classmethod
    def build(cls, request: Request) -> ScatteredSum:
        return cls(request.shard, request.chunk_elems, request.codec, request.shared_params)

    def gather_params(self, comm, params) -> int:
        if self.shared_params is not None:
            return self.shared_params.allgather(self.shard, self.chunk_elems)
        return self.shard.allgather(comm, params, self.chunk_elems)

    def _sum_tail(self, comm, tail) -> int:
        """The tail summed on every rank (MPI's Allgather: its bytes computed, not counted)."""
        gathered = np.empty((comm.size,) + tail.shape, dtype=tail.dtype)
        comm.Allgather(np.ascontiguousarray(tail), gathered)
        total = gathered[0].copy()
        for src in range(1, comm.size):
            total += gathered[src]
        tail[...] = total
        return allgather_bytes(tail.nbytes, comm.size)

    def run(self, bucket, comm, seq: int) -> Reduced:
        tail_sent = self._sum_tail(comm, bucket.tail)
        payload = bucket.payload
        if self._rounds is None:
            self._rounds = self.shard.rounds(self.chunk_elems)
            longest = max(hi - lo for pieces in self._rounds for lo, hi in pieces)
            self._scratch = np.empty(comm.size * max(1, longest), dtype=payload.dtype)
        if self.codec is not None:
            return self._run_coded(comm, payload, tail_sent)
        rank, sent = comm.rank, tail_sent
        for pieces in self._rounds:
            lo, hi = pieces[rank]
            mine = hi - lo
            send_counts = [b - a for a, b in pieces]
            recv = self._scratch[: comm.size * mine]
            comm.Alltoallv([payload, (send_counts, [a for a, _ in pieces])],
                           [recv, ([mine] * comm.size, [mine * r for r in range(comm.size)])])
            if mine:
                rows = recv.reshape(comm.size, mine)
                total = rows[0].copy()
                for src in range(1, comm.size):
                    total += rows[src]
                payload[lo:hi] = total
            sent += (sum(send_counts) - mine) * payload.itemsize
        return Reduced(len(self._rounds), sent, "host, reduce-scatter (comm.shard=optimizer)")

    def _run_coded(self, comm, payload, tail_sent: int) -> Reduced:
        """The reduce-scatter in the codec's words: every rank codes its piece of each owner's
        slice, each owner decodes and adds them in float32, in rank order."""
        codec, words16, rank, sent = self.codec, mpi_module().UINT16_T, comm.rank, tail_sent
        for pieces in self._rounds:
            words = [codec.words(b - a) for a, b in pieces]
            offsets = np.concatenate([[0], np.cumsum(words[:-1])]).astype(int).tolist()
            outgoing = np.empty(sum(words), np.uint16)
            for owner, (a, b) in enumerate(pieces):
                codec.encode(payload[a:b], outgoing[offsets[owner]: offsets[owner] + words[owner]])
            mine = words[rank]
            incoming = np.empty(mine * comm.size, np.uint16)
            comm.Alltoallv([outgoing, (words, offsets), words16],
                           [incoming, ([mine] * comm.size, [mine * src for src in range(comm.size)]), words16])
            lo, hi = pieces[rank]
            if hi > lo:
                payload[lo:hi] = codec.sum_blocks((incoming[src * mine: (src + 1) * mine]
                                                   for src in range(comm.size)), hi - lo)
            sent += int(outgoing.nbytes) - mine * 2
        return Reduced(len(self._rounds), sent, f"host, reduce-scatter, wire {codec.name} (comm.shard=optimizer)")
