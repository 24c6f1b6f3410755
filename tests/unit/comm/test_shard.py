"""How `comm.shard=optimizer` cuts the parameters into slices and rounds (pure)."""

from __future__ import annotations

import pytest

from hpc_rlx.comm.shard import ParamShard


@pytest.mark.parametrize("size, trainable, world", [(10, 7, 3), (5, 5, 8), (1000, 990, 4), (64, 0, 2)])
def test_the_slices_cover_the_parameters_once(size, trainable, world):
    shards = [ParamShard(size, trainable, r, world) for r in range(world)]
    covered = [i for s in shards for i in range(s.lo, s.hi)]
    assert covered == list(range(size))
    stepped = [i for s in shards for i in range(s.trainable.start, s.trainable.stop)]
    assert stepped == list(range(trainable))
    buffers = [i for s in shards for i in range(s.buffers.start, s.buffers.stop)]
    assert buffers == list(range(trainable, size))
    assert sum(s.n_local for s in shards) == trainable


@pytest.mark.parametrize("chunk", [1, 7, 40, 10_000])
def test_rounds_cover_every_slice_and_stay_under_the_chunk(chunk):
    shard = ParamShard(1003, 1000, 0, 4)
    rounds = shard.rounds(chunk)
    for rank, (lo, hi) in enumerate(shard.bounds):
        pieces = [r[rank] for r in rounds]
        assert pieces[0][0] == lo and pieces[-1][1] == hi
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    longest = max(b - a for r in rounds for a, b in r)
    assert 4 * longest <= max(chunk, 4)      # a rank receives one piece from every rank
