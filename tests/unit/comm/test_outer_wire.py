"""The outer syncs' coded wire (`policy.outer_wire_dtype`): the 8- and 4-bit codecs' round trip
on known vectors, and error feedback carrying exactly what a coding dropped."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm.feedback_wire import FeedbackWireSum
from hpc_rlx.comm.quant_codec import GROUP, OUTER_WIRE_CODECS, Int4Codec, Int8Codec, normalize_outer_wire
from hpc_rlx.errors import ConfigError


@pytest.mark.parametrize("codec, qmax", [(Int8Codec(), 127), (Int4Codec(), 7)])
def test_values_on_the_grid_of_their_group_come_back_exactly(codec, qmax):
    # two groups and a short third one; each group's largest magnitude sets its step
    step = np.array([0.5, 2.0 ** -6, 3.0], np.float32)
    n = 2 * GROUP + 5
    codes = np.tile(np.arange(-qmax, qmax + 1), n)[:n]
    codes[-5:] = [qmax, -1, 0, 1, -qmax]
    x = (codes * np.repeat(step, GROUP)[:n]).astype(np.float32)
    for g in range(3):       # every group holds +-qmax steps, so its scale is the step
        assert np.max(np.abs(codes[g * GROUP:(g + 1) * GROUP])) == qmax
    out = np.empty(codec.words(n), np.uint16)
    codec.encode(x, out)
    assert np.array_equal(codec.decode(out, n), x)
    # scales are float32 words ahead of the codes: 3 groups, then n codes packed
    assert out.size == 2 * 3 + -(-n // (16 // codec.bits))


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec()])
def test_rounding_is_to_the_nearest_step_half_to_even(codec):
    q = codec.qmax
    x = np.array([q, 0.5, 1.5, 2.5, -0.5, -1.5, 0.49, -q], np.float32)   # scale 1: largest is q
    assert np.array_equal(codec.round_trip(x), np.array([q, 0, 2, 2, -0, -2, 0, -q], np.float32))


def test_a_group_with_a_nan_or_an_infinity_decodes_to_nan_and_the_others_do_not():
    codec = Int8Codec()
    x = np.ones(2 * GROUP, np.float32)
    x[3] = np.inf
    back = codec.round_trip(x)
    assert np.all(np.isnan(back[:GROUP])) and np.array_equal(back[GROUP:], x[GROUP:])


def test_a_zero_group_codes_to_zeros():
    assert np.array_equal(Int4Codec().round_trip(np.zeros(10, np.float32)), np.zeros(10, np.float32))


def test_the_outer_wire_names():
    assert set(OUTER_WIRE_CODECS) == {"bfloat16", "float16", "int8", "int4"}
    assert normalize_outer_wire(None) is None and normalize_outer_wire("null") is None
    assert normalize_outer_wire("INT4") == "int4"
    with pytest.raises(ConfigError, match="policy.outer_wire_dtype must be null, bfloat16, float16, int8, int4; got 'int2'"):
        normalize_outer_wire("int2")


@pytest.mark.parametrize("name", ["int4", "int8", "bfloat16"])
def test_error_feedback_carries_what_each_coding_dropped_to_the_next_sync(name):
    # one segment [0, n) seen as a rank's input and as its owner's sum, over three syncs: every
    # residual is exactly what that sync's coding dropped, and what arrives over the syncs plus
    # the last residual is exactly what was meant to be sent (dyadic values: no float rounding)
    codec = OUTER_WIRE_CODECS[name]
    n = 40
    path = FeedbackWireSum(codec, chunk_elems=1 << 20, n_payload=n, dtype=np.float64, deterministic=True)
    rng = np.random.default_rng(0)
    sent_total, arrived_total = np.zeros(n), np.zeros(n)
    sums_total, sums_arrived = np.zeros(n), np.zeros(n)
    for _ in range(3):
        x = rng.integers(-1000, 1000, n) / 256.0
        before = path.sent_residual.copy()
        payload = x.copy()
        out = np.empty(codec.words(n), np.uint16)
        path.code_input(payload, 0, n, out)
        arrived = codec.decode(out, n).astype(np.float64)
        assert np.array_equal(path.sent_residual, x + before - arrived)
        sent_total += x
        arrived_total += arrived

        s = (rng.integers(-1000, 1000, n) / 64.0).astype(np.float32)    # the owner's float32 sum
        before = path.sum_residual.copy()
        total = s.copy()
        path.code_sum(total, 0, n, out)
        got = codec.decode(out, n).astype(np.float64)
        assert np.array_equal(path.sum_residual, s + before - got)
        sums_total += s
        sums_arrived += got
    assert np.array_equal(arrived_total + path.sent_residual, sent_total)
    assert np.array_equal(sums_arrived + path.sum_residual, sums_total)
    assert np.any(path.sent_residual != 0)          # the codings did drop something
    state = path.state_dict()
    path.drop_residuals()
    assert not np.any(path.sent_residual) and not np.any(path.sum_residual)
    path.load_state_dict(state)
    assert np.array_equal(path.sent_residual, state["sent_residual"])
