"""`wire_bytes`: bytes the ranks sent in the training step's collectives, summed over ranks."""

from __future__ import annotations

from .base import Metric, Window


class WireBytes(Metric):
    """Bytes on the wire over the span, summed over ranks: what the reduction paths count
    (`comm.reduce.Reduced.wire_bytes`, the sharded allgather) and, for MPI's own collectives,
    their ring algorithm's volume (`comm.wire_volume`). The count is gathered once per epoch
    (`runtime.train`), so it is an epoch figure only: steps.jsonl does not carry it."""
    epoch_key = "wire_bytes"

    def value(self, window: Window) -> int | None:
        sent = window.counts.get("wire_bytes")
        return None if sent is None else int(sent)
