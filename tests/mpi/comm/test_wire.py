"""The 16-bit wire (comm.wire_dtype): codecs against PyTorch's conversions, error bounds, and
the compressed Allreduce under real mpirun against the float32 result."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_rlx.comm import wire
from hpc_rlx.base.even_split import segments
from hpc_rlx.base.errors import ConfigError

from tests.support.jobs import REPO, explain, mpirun, train_job

def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    """PyTorch's float32 -> bfloat16 conversion (round to nearest even), as raw words."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def test_normalize_wire():
    assert wire.normalize_wire(None) is None
    assert wire.normalize_wire("null") is None and wire.normalize_wire("float32") is None
    assert wire.normalize_wire("bf16") == "bfloat16" and wire.normalize_wire("BFloat16") == "bfloat16"
    assert wire.normalize_wire("fp16") == "float16" and wire.normalize_wire("half") == "float16"
    with pytest.raises(ConfigError, match="comm.wire_dtype.*'int8'"):
        wire.normalize_wire("int8")
    with pytest.raises(ConfigError, match="16"):
        wire.normalize_wire(16)


def test_bf16_rounding_matches_torch_on_edge_cases():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -7)
    x = np.array([0.0, -0.0, 1.0, one + ulp / 2, one + 3 * ulp / 2, one + ulp / 2 + 2 ** -20,
                  3.4e38, -3.4e38, np.inf, -np.inf, 1e-40, -1e-45, 65504.0, 1 / 3, -2.5e-30],
                 dtype=np.float32)
    np.testing.assert_array_equal(wire.f32_to_bf16_bits(x), torch_bf16_bits(x))
    nan = wire.f32_to_bf16_bits(np.array([np.nan, -np.nan, np.float32(np.nan)], np.float32))
    assert np.isnan(wire.bf16_bits_to_f32(nan)).all()
    # a signalling NaN must not turn into infinity when rounded
    snan = np.array([0x7F800001], np.uint32).view(np.float32)
    assert np.isnan(wire.bf16_bits_to_f32(wire.f32_to_bf16_bits(snan)))[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=True), min_size=1, max_size=64))
def test_bf16_matches_torch_everywhere(values):
    x = np.array(values, np.float32)
    np.testing.assert_array_equal(wire.f32_to_bf16_bits(x), torch_bf16_bits(x))
    back = wire.bf16_bits_to_f32(wire.f32_to_bf16_bits(x))
    finite = np.isfinite(back) & np.isfinite(x)
    assert np.all(np.abs(back[finite] - x[finite]) <= 2.0 ** -8 * np.abs(x[finite]) + 2.0 ** -134)  # subnormal spacing


@pytest.mark.parametrize("codec", wire.WIRE_DTYPES)
@pytest.mark.parametrize("magnitude", [1e-12, 1e-4, 1.0, 3e4, 1e9])
def test_blocks_round_trip_within_one_rounding(codec, magnitude):
    x = (np.random.default_rng(3).standard_normal(1000) * magnitude).astype(np.float32)
    words = np.empty(wire.block_words(x.size), np.uint16)
    wire.pack_block(x, codec, words)
    back = wire.unpack_block(words, codec)
    peak = float(np.abs(x).max())
    bound = wire.UNIT_ROUNDOFF[codec] * np.abs(x) + (peak * 2.0 ** -37 if codec == "float16" else 2.0 ** -134)
    assert np.all(np.abs(back - x) <= bound), float(np.max(np.abs(back - x) / np.maximum(bound, 1e-300)))
    if codec == "float16":
        # plain float16 would overflow at 1e9 and flush 1e-12 to zero: the block scale prevents both
        assert np.isfinite(back).all() and np.count_nonzero(back) == np.count_nonzero(x)


def test_float16_block_keeps_infinities_and_nans():
    x = np.array([1.0, np.inf, -np.inf, np.nan, 2.0], np.float32)
    words = np.empty(wire.block_words(5), np.uint16)
    wire.pack_block(x, "float16", words)
    back = wire.unpack_block(words, "float16")
    assert back[0] == 1.0 and back[4] == 2.0 and back[1] == np.inf and back[2] == -np.inf and np.isnan(back[3])


def test_empty_block_and_segments():
    words = np.empty(wire.block_words(0), np.uint16)
    wire.pack_block(np.empty(0, np.float32), "bfloat16", words)
    assert wire.unpack_block(words, "bfloat16").size == 0
    assert segments(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert segments(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match="need 5 words"):
        wire.pack_block(np.ones(3, np.float32), "bfloat16", np.empty(4, np.uint16))


# ---- under mpirun ------------------------------------------------------------------------

WORKER = r'''
import hashlib, json, sys
import numpy as np
from mpi4py import MPI
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.comm import wire
comm = MPI.COMM_WORLD
codec, n, cap_mb, dtype = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), np.dtype(sys.argv[4])

def data(rank):
    rng = np.random.default_rng(100 + rank)
    # mixed scales, as gradients have: most tiny, a few large
    return (rng.standard_normal(n) * np.exp(rng.uniform(-12, 4, n))).astype(dtype)

tail_fields = ("samples", "loss_sum", "flag")
bucket = FusedBucket(n, tail_fields, dtype, cap_mb=cap_mb, wire_dtype=codec)
ref = FusedBucket(n, tail_fields, dtype, cap_mb=cap_mb)
for b in (bucket, ref):
    b.payload[...] = data(comm.rank)
    # values no 16-bit format holds exactly: the tail must stay exact
    b["samples"] = 1_000_003 + comm.rank
    b["loss_sum"] = 12345.678 + comm.rank
    b["flag"] = 1.0 if comm.rank == comm.size - 1 else 0.0
bucket.allreduce(comm)
ref.allreduce(comm)
got = bucket.payload.astype(np.float64)
exact = np.sum([data(r).astype(np.float64) for r in range(comm.size)], axis=0)
abs_sum = np.sum([np.abs(data(r).astype(np.float64)) for r in range(comm.size)], axis=0)
peak = max(float(np.abs(data(r)).max()) for r in range(comm.size))
bound = wire.error_bound(codec, abs_sum, exact, comm.size, peak=peak)
excess = float(np.max(np.abs(got - exact) - bound))
rel = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
digest = hashlib.sha256(bucket.buffer.tobytes()).hexdigest()
digests = comm.allgather(digest)
if comm.rank == 0:
    print("RESULT " + json.dumps({
        "excess": excess, "rel": rel, "same_everywhere": len(set(digests)) == 1,
        "tail": [bucket["samples"], bucket["loss_sum"], bucket["flag"]],
        "tail_ref": [ref["samples"], ref["loss_sum"], ref["flag"]],
        "chunks": bucket.last_chunks, "wire_bytes": bucket.last_wire_bytes, "ref_bytes": ref.last_wire_bytes,
        "path": bucket.last_path}))
'''


def run_worker(tmp_path, ranks, codec, n, cap_mb, dtype="float32"):
    script = tmp_path / "wire_worker.py"
    script.write_text(WORKER)
    proc = mpirun(ranks, [str(script), codec, str(n), str(cap_mb), dtype], timeout=120,
                  env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, explain(proc)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,codec,n,cap_mb,dtype", [
    (2, "bfloat16", 50_001, 16, "float32"),
    (4, "bfloat16", 30_003, 0.05, "float32"),      # chunked: several chunks, uneven segments
    (4, "float16", 30_003, 0.05, "float32"),
    (3, "float16", 20_000, 16, "float64"),         # a float64 bucket: quarter of the bytes
    (4, "bfloat16", 3, 16, "float32"),             # fewer values than ranks: empty segments
])
def test_compressed_allreduce_matches_float32_within_the_bound(tmp_path, ranks, codec, n, cap_mb, dtype):
    res = run_worker(tmp_path, ranks, codec, n, cap_mb, dtype)
    assert res["excess"] <= 0.0, res                       # every element inside its error bound
    assert res["rel"] < 4 * wire.UNIT_ROUNDOFF[codec], res
    assert res["same_everywhere"], res                     # identical bits on every rank
    assert res["tail"] == res["tail_ref"], res              # the tail is exact, never compressed
    assert res["tail"][0] == sum(1_000_003 + r for r in range(ranks))
    if cap_mb < 1:
        assert res["chunks"] > 1
    if n > 1000:
        itemsize = np.dtype(dtype).itemsize
        assert res["wire_bytes"] == pytest.approx(res["ref_bytes"] * 2 / itemsize, rel=0.02), res
    assert "wire" in res["path"]


WIRE_STEPS = REPO / "tests" / "support" / "mpi_scripts" / "wire_steps.py"


@pytest.mark.mpi
def test_a_training_step_on_a_bfloat16_wire_is_the_float32_step_within_the_wire_bound(tmp_path, digits_h5):
    """One SGD step of a real 2-rank run, without a wire and on a bfloat16 wire, from the same
    start with the same gradients sent: the float32 run steps with g = g0 + g1 (2 ranks: MPI's
    sum has one order), the wire run with bfloat16(bf(g0) + bf(g1)) (float32 sum), bitwise, which
    is within `wire.error_bound` of g; so the parameters are within lr / samples x that bound
    (and the last bits of the subtraction). The step bound replaces a 15% margin on the
    validation loss of a longer run, which no coding step implies."""
    proc = mpirun(2, [str(WIRE_STEPS), str(digits_h5), str(tmp_path), "f32", "wire"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    plain, coded = np.load(tmp_path / "f32.npz"), np.load(tmp_path / "wire.npz")
    assert np.array_equal(plain["before"], coded["before"]) and np.array_equal(plain["sent"], coded["sent"])
    sent = plain["sent"]
    exact = sent[0] + sent[1]
    bf16 = wire.codec_named("bfloat16")
    total = np.zeros(sent.shape[1], np.float32)
    for g in sent:
        total += bf16.round_trip(g)
    on_wire = bf16.round_trip(total).astype(np.float64)
    for r in range(2):
        assert np.array_equal(plain["applied"][r], exact), r
        assert np.array_equal(coded["applied"][r], on_wire), r
    bound = wire.error_bound("bfloat16", np.abs(sent).sum(axis=0), exact, 2)
    assert np.all(np.abs(on_wire - exact) <= bound)
    scale = float(plain["scale"][0])
    a, b = plain["after"][0], coded["after"][0]
    slack = 2 * np.spacing(np.maximum(np.abs(a), np.abs(b)))
    assert np.all(np.abs(a - b) <= scale * np.abs(on_wire - exact) + slack)
    assert np.all(np.abs(a - b) <= scale * bound + slack)
    assert np.any(a != b)


@pytest.mark.mpi
def test_unknown_wire_dtype_fails_on_every_rank(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "comm.wire_dtype=int8"], timeout=60)
    assert proc.returncode != 0
    assert "comm.wire_dtype must be null, bfloat16 or float16; got 'int8'" in proc.stderr, explain(proc)
    assert proc.stderr.count("hpc_rlx: error") == 1, explain(proc)
