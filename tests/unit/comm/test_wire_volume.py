"""The bytes-on-the-wire formulas (`comm.wire_volume`) on known sizes, and the running count."""

from __future__ import annotations

import pytest

from hpc_rlx.comm.wire_volume import WireCount, allgather_bytes, allgatherv_bytes, allreduce_bytes


@pytest.mark.parametrize("ranks, nbytes, sent", [
    (1, 4000, 0),               # nothing to send on one rank
    (2, 4000, 4000),            # 2 (N - 1) / N = 1
    (4, 4000, 6000),            # 3/2 of the message
    (8, 4096, 7168),            # 7/4
    (3, 10, 13),                # 2 * 2 * 10 // 3: floor
])
def test_a_ring_allreduce_sends_2_n_minus_1_over_n_of_the_message(ranks, nbytes, sent):
    assert allreduce_bytes(nbytes, ranks) == sent


def test_the_ring_allreduce_volume_is_its_reduce_scatter_plus_its_allgather():
    # per rank: (N - 1) segments of nbytes / N out in the reduce-scatter, as many in the allgather
    for ranks in (2, 4, 8):
        nbytes = 1024 * ranks
        segment = nbytes // ranks
        assert allreduce_bytes(nbytes, ranks) == 2 * allgather_bytes(segment, ranks)


def test_a_ring_allgather_sends_every_block_but_the_receivers_own():
    assert allgather_bytes(100, 1) == 0
    assert allgather_bytes(100, 2) == 100
    assert allgather_bytes(100, 4) == 300


def test_a_ring_allgatherv_rank_forwards_every_block_but_its_successors():
    counts = [10, 20, 30, 40]
    assert [allgatherv_bytes(counts, r) for r in range(4)] == [80, 70, 60, 90]
    # over the ranks: every block travels N - 1 times
    assert sum(allgatherv_bytes(counts, r) for r in range(4)) == 3 * sum(counts)
    assert allgatherv_bytes([10], 0) == 0


def test_the_count_splits_into_epochs():
    count = WireCount()
    count.add(100)
    count.add(50)
    assert count.epoch() == 150
    count.add(7)
    assert count.epoch() == 7
    assert count.epoch() == 0
    assert count.sent == 157
