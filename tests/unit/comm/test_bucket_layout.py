"""`BucketLayout.for_world` / `within`: the per-rank slots laid out again for fewer ranks (a
failure shrank the job) in the same memory, the payload where it was (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm.bucket_layout import CONTROL_FLAGS, BucketLayout
from hpc_rlx.comm.collective import FusedBucket


@pytest.mark.parametrize("tail_first", [False, True])
def test_fewer_ranks_keep_the_payload_in_place_and_read_their_own_slots(tail_first):
    old = BucketLayout(10, ("samples",), ("steps", *CONTROL_FLAGS), world_size=4, tail_first=tail_first)
    buffer = np.arange(old.size, dtype=np.float64)
    payload = old.payload_of(buffer)
    new = old.for_world(2)
    assert new.tail_size == 1 + 4 * 2 and new.size == 19 and new.fields == old.fields
    inner = new.within(buffer, old)
    assert inner.base is buffer and inner.size == new.size
    assert np.shares_memory(new.payload_of(inner), payload)
    assert np.array_equal(new.payload_of(inner), payload)       # the very same elements
    tail = new.tail_of(inner)
    tail[...] = 0
    new.write(tail, "steps", 7.0, rank=1)
    new.write(tail, "stop", 1.0, rank=0)
    assert list(new.read(tail, "steps"))[1] == 7.0 and new.flags(tail)["stop"] and not new.flags(tail)["nonfinite"]
    assert not np.shares_memory(tail, payload)


def test_a_longer_tail_does_not_fit():
    small = BucketLayout(4, (), ("steps",), world_size=2)
    with pytest.raises(ValueError, match="does not fit"):
        small.for_world(3).within(np.zeros(small.size), small)


def test_the_bucket_lays_out_its_slots_again_and_its_payload_views_stay_valid():
    bucket = FusedBucket(6, ("samples",), np.float64, rank_fields=("steps",), world_size=3, overlap=True)
    view = bucket.payload
    view[...] = 5.0
    assert not bucket.world_changed(2)      # a private bucket: no shared window to leave
    assert bucket.layout.world_size == 2 and bucket.buffer.size == 6 + 1 + 2
    assert np.shares_memory(bucket.payload, view) and np.all(bucket.payload == 5.0)
    bucket.put("steps", 3.0, 1)
    assert list(bucket["steps"]) == [0.0, 3.0]


def test_a_rank_without_a_slot_cannot_write_into_the_next_field():
    layout = BucketLayout(4, ("samples",), ("steps", "stop"), world_size=2)
    tail = np.zeros(layout.tail_size)
    layout.write(tail, "samples", 5.0, rank=7)       # a summed field: any rank adds to it
    with pytest.raises(ValueError, match="rank 2 has no slot of 'steps'"):
        layout.write(tail, "steps", 1.0, rank=2)
    assert list(layout.read(tail, "stop")) == [0.0, 0.0]
