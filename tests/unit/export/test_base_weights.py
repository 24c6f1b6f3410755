"""export --base: where a part dynamo's optimizer folded lies in its original parameter."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.export.base_weights import locate, place_parts
from hpc_rlx.export.trained import ExportError


def test_a_slice_is_found_with_the_unsqueezed_dims_of_a_gather():
    table = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    assert locate(table[2:7][None], table) == (slice(2, 7), slice(0, 4))   # BART's positions: rows 2.. as (1, t, d)
    pos = table[None]
    assert locate(pos[:, :3], pos) == (slice(0, 1), slice(0, 3), slice(0, 4))
    assert locate(table[1:3] + 1, table) is None
    with pytest.raises(ExportError, match="appears 3 times"):
        locate(np.zeros((1, 4), np.float32), np.zeros((3, 4), np.float32))


def test_the_trained_part_goes_back_and_gathered_rows_stay_apart():
    table = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    meta = {"params": {"p": "slice_1", "g": "gathered"}, "slices": {"p": "pos", "g": "bias_table"},
            "removed": ["head.bias"]}
    out = {"slice_1": np.ones((1, 2, 3), np.float32), "gathered": np.ones((4, 3), np.float32)}
    base = {"pos": table, "bias_table": table, "head.bias": np.zeros(3, np.float32)}
    notes = place_parts(out, meta, {"p": table[1:3][None], "g": table[[0, 0, 5, 2]]}, base)
    assert sorted(out) == ["gathered", "head.bias", "pos"]
    np.testing.assert_array_equal(out["pos"][1:3], 1)
    np.testing.assert_array_equal(np.delete(out["pos"], [1, 2], axis=0), np.delete(table, [1, 2], axis=0))
    assert len(notes) == 1 and "'gathered' holds rows of 'bias_table'" in notes[0]


def test_a_whole_parameter_in_another_shape_is_located_as_the_whole():
    """A norm's weight written as (C, 1) for its broadcast (dynamo's GroupNorm)."""
    full = np.arange(16, dtype=np.float32)
    assert locate(full.reshape(16, 1), full) == (slice(0, 16),)
    assert locate(full[::-1].reshape(16, 1).copy(), full) is None
