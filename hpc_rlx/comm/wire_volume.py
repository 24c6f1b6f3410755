"""Bytes on the wire: what one rank sends in a collective, and its running count.

Paths that move the data themselves count what they send (`reduce.WireSum`'s Alltoallv and
Allgatherv, `shard.ScatteredSum`'s Alltoallv). Where MPI's own collective moves it (MPI's
Allreduce, Allgather, Allgatherv) nothing can be counted from Python, so the figure is
computed from the volume of the bandwidth-optimal algorithm, the one MPICH and Open MPI use
for large messages:

- Allreduce of ``nbytes`` on N ranks: a ring, or reduce-scatter + allgather (Rabenseifner),
  sends ``2 (N - 1) / N * nbytes`` per rank (`allreduce_bytes`). For small messages MPI may
  pick recursive doubling instead (``log2(N) * nbytes`` per rank): the figure is then the
  ring's, not what MPI moved.
- Allgather of one ``block_bytes`` block per rank: a ring sends every block but the
  receiver's own, ``(N - 1) * block_bytes`` per rank (`allgather_bytes`).
- Allgatherv of blocks of ``counts_bytes``: in a ring, rank i forwards every block but its
  successor's, ``sum(counts_bytes) - counts_bytes[(i + 1) % N]`` (`allgatherv_bytes`).

Pure: no MPI.
"""

from __future__ import annotations

from typing import Sequence


def allreduce_bytes(nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring (reduce-scatter + allgather) Allreduce of ``nbytes``:
    ``2 (N - 1) * nbytes // N``; 0 on one rank."""
    ranks = max(1, int(ranks))
    return int(2 * (ranks - 1) * int(nbytes) // ranks)


def allgather_bytes(block_bytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring Allgather of one ``block_bytes`` block per rank."""
    return int((max(1, int(ranks)) - 1) * int(block_bytes))


def allgatherv_bytes(counts_bytes: Sequence[int], rank: int) -> int:
    """Bytes rank ``rank`` sends in a ring Allgatherv of blocks of ``counts_bytes`` (every block
    but its successor's)."""
    n = len(counts_bytes)
    if n <= 1:
        return 0
    return int(sum(counts_bytes) - counts_bytes[(int(rank) + 1) % n])


class WireCount:
    """This rank's bytes on the wire since the run started (`sent`), and per epoch (`epoch`:
    the bytes since the previous call)."""

    def __init__(self) -> None:
        self.sent = 0
        self._mark = 0

    def add(self, nbytes: int) -> None:
        self.sent += int(nbytes)

    def epoch(self) -> int:
        """The bytes sent since the last call (the epoch that just ended)."""
        done, self._mark = self.sent - self._mark, self.sent
        return int(done)
