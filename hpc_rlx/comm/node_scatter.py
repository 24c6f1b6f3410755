"""`comm.shard=optimizer` on one node: the bucket's reduce-scatter through the node's shared
memory (``comm.shared_memory``) instead of MPI messages.

The bucket lives in the rank's segment of the node's shared window, as for `node_memory`'s sum.
One reduce-scatter is then:

1. node barrier: every segment holds this step's gradients;
2. each rank adds, in rank order, every rank's copy of its own slice (`shard.ParamShard`) and
   of the tail (counts, loss, flags), into scratch memory of its own;
3. node barrier: nobody reads a segment any more;
4. each rank writes its slice's sum and the tail's into its own segment.

No message and two barriers, where `shard.ScatteredSum` takes an Allgather of the tail and an
Alltoallv of the payload: with two ranks on a core, every blocking collective waits for a rank
the scheduler has not run yet, and the sharded step had three of them (one, the parameters'
allgather, stays; with ``comm.node_shared_params`` it is two barriers too). The additions are
those of `ScatteredSum` in the same order, so the two paths give the same bits.

Only when the whole job is one node: across nodes a slice's sum needs every node's copy, which
MPI's reduce-scatter brings (the sharded sum keeps `ScatteredSum` there, and the start-up line
says why).
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.node_memory import NodeSharedSum
from hpc_rlx.comm.reduce import Reduced


class NodeScatteredSum(NodeSharedSum):
    """The sharded bucket's reduce-scatter in the node's shared window (one node)."""

    def attach(self, shard, layout) -> None:
        """The slice this rank owns (`ParamShard`) and where the payload and the tail sit in a
        segment (`bucket_layout.BucketLayout`)."""
        self.shard, self.layout = shard, layout
        self.path = f"node shared memory ({self.node.size} ranks)"
        start = layout.payload_start
        self._slice = slice(start + shard.lo, start + shard.hi)
        self._tail = slice(layout.tail_start, layout.tail_start + layout.tail_size)

    def run(self, bucket, comm, seq: int) -> Reduced:
        if bucket.buffer is not self.segment:
            raise RuntimeError("the bucket's buffer is not this rank's shared segment")
        node = self.node
        node.Barrier()
        peers = [self._view(r) for r in range(node.size)]
        mine = peers[0][self._slice].copy()
        tail = peers[0][self._tail].copy()
        for seg in peers[1:]:                      # rank order: ScatteredSum's additions
            mine += seg[self._slice]
            tail += seg[self._tail]
        node.Barrier()
        self.segment[self._slice] = mine
        self.segment[self._tail] = tail
        return Reduced(1, 0, self.path)
