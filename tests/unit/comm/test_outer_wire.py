"""The outer syncs' coded wire (`policy.outer_wire_dtype`): the 8- and 4-bit codecs' round trip
on known vectors, and error feedback: each sync codes its values plus what the syncs before
dropped, the carried error stays within one coding step, and over many syncs what arrived
tracks what was sent within one step (where the plain coding drifts away)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm.feedback_wire import FeedbackWireSum
from hpc_rlx.comm.quant_codec import GROUP, OUTER_WIRE_CODECS, Int4Codec, Int8Codec, IntCodec, normalize_outer_wire
from hpc_rlx.comm.reduce import OrderedSum, WireSum
from hpc_rlx.base.errors import ConfigError


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
        assert np.array_equal(arrived, codec.round_trip(x + before))      # the carried error went along
        assert np.array_equal(path.sent_residual, x + before - arrived)
        sent_total += x
        arrived_total += arrived

        s = (rng.integers(-1000, 1000, n) / 64.0).astype(np.float32)    # the owner's float32 sum
        before = path.sum_residual.copy()
        total = s.copy()
        path.code_sum(total, 0, n, out)
        got = codec.decode(out, n).astype(np.float64)
        assert np.array_equal(got, codec.round_trip(s + before))
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


# ---- many syncs: the carried error is bounded, the sums track ------------------------------------

def coding_step(codec, values: np.ndarray) -> np.ndarray:
    """The distance between neighbouring codes around each of `values` (one block): a group's
    scale (largest magnitude / qmax) for the integer codes, the spacing of the 16-bit float
    at the value for the others (float16 after its power-of-two block scale)."""
    v = np.abs(values.astype(np.float32)).astype(np.float64)
    if isinstance(codec, IntCodec):
        step = np.empty_like(v)
        for g in range(0, v.size, GROUP):
            step[g:g + GROUP] = float(np.float32(v[g:g + GROUP].max()) / np.float32(codec.qmax))
        return step
    if codec.name == "bfloat16":
        exponent = np.floor(np.log2(np.where(v > 0, v, 2.0 ** -126)))
        return 2.0 ** (np.maximum(exponent, -126) - 7)
    _, top = np.frexp(v.max())
    scale = 2.0 ** float(np.clip(14 - top, -120, 120))       # the block's largest near 2**14
    return np.spacing(np.abs(v * scale).astype(np.float16)).astype(np.float64) / scale


def _inputs(kind: str, n: int, syncs: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    if kind == "random":     # magnitudes over four orders, changing from sync to sync
        return [rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n) for _ in range(syncs)]
    # the same values every sync, off the codes' grid: a plain coding drops the same part each time
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1, n)
    return [x] * syncs


@pytest.mark.parametrize("name", ["int4", "int8", "bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["random", "constant"])
def test_over_many_syncs_the_error_stays_within_a_step_and_what_arrived_tracks_what_was_sent(name, kind):
    codec = OUTER_WIRE_CODECS[name]
    n, syncs = 3 * GROUP + 17, 150
    path = FeedbackWireSum(codec, chunk_elems=1 << 20, n_payload=n, dtype=np.float64, deterministic=True)
    sent = np.zeros(n)
    arrived_sum = np.zeros(n)
    for sync, x in enumerate(_inputs(kind, n, syncs)):
        carried = path.sent_residual.copy()
        out = np.empty(codec.words(n), np.uint16)
        path.code_input(x.copy(), 0, n, out)
        arrived = codec.decode(out, n).astype(np.float64)
        # the code is the codec's own round trip of the values plus the carried error
        assert np.array_equal(arrived, codec.round_trip(x + carried)), sync
        step = coding_step(codec, x + carried)
        assert np.all(np.abs(path.sent_residual) <= step), (sync, np.max(np.abs(path.sent_residual) / step))
        sent += x
        arrived_sum += arrived
        assert np.all(np.abs(sent - arrived_sum) <= step), (sync, np.max(np.abs(sent - arrived_sum) / step))


@pytest.mark.parametrize("name", ["int4", "int8", "bfloat16", "float16"])
def test_without_error_feedback_the_sum_of_what_arrived_drifts(name):
    # the same values every sync through the plain wire's coding (WireSum: nothing carried):
    # every sync drops the same part, and the sums part by many steps, where with feedback they
    # stay within one (the test above, kind="constant")
    codec = OUTER_WIRE_CODECS[name]
    n, syncs = 3 * GROUP + 17, 150
    plain = WireSum(codec, 1 << 20, OrderedSum(1 << 20), "host")
    x = _inputs("constant", n, 1)[0]
    out = np.empty(codec.words(n), np.uint16)
    arrived_sum = np.zeros(n)
    for _ in range(syncs):
        plain.code_input(x.copy(), 0, n, out)
        arrived_sum += codec.decode(out, n)
    drift = np.abs(syncs * x - arrived_sum) / coding_step(codec, x)
    assert np.max(drift) > 20, np.max(drift)


def test_each_fragment_carries_its_own_error():
    # a streaming sync codes one fragment at a time (`offset`: its place in the parameters):
    # the errors carried are per parameter, so alternating fragments never take each other's
    codec = OUTER_WIRE_CODECS["int4"]
    n, half = 2 * GROUP, GROUP
    path = FeedbackWireSum(codec, chunk_elems=1 << 20, n_payload=n, dtype=np.float64, deterministic=True)
    rng = np.random.default_rng(5)
    out = np.empty(codec.words(half), np.uint16)
    for sync in range(20):
        path.offset = (sync % 2) * half
        lo = path.offset
        x = rng.standard_normal(half)
        carried = path.sent_residual[lo:lo + half].copy()
        other = np.delete(path.sent_residual, np.s_[lo:lo + half]).copy()
        path.code_input(x.copy(), 0, half, out)
        assert np.array_equal(codec.decode(out, half), codec.round_trip(x + carried)), sync
        assert np.array_equal(np.delete(path.sent_residual, np.s_[lo:lo + half]), other), sync
