"""Reduction paths by name (comm.reduction, `hpc_rlx.comm.registry`) and the 16-bit codecs as
a piece of their own (`hpc_rlx.comm.codec`): `auto` builds what the settings always built, a
named path is refused where it cannot serve them (one clear error on every rank), and a named
path sums as its `auto` twin does, bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_rlx.comm import codec as codecs
from hpc_rlx.comm import registry, wire
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.config import schema
from hpc_rlx.base import cuda_mpi
from hpc_rlx.base.errors import ConfigError

from tests.support.jobs import REPO, explain, mpirun, train_job

HOST = cuda_mpi.PathChoice(cuda_mpi.HOST, "no GPU lane on this rank")
STAGED = cuda_mpi.PathChoice(cuda_mpi.STAGED, "MPI is not known to be CUDA-aware")
DIRECT = cuda_mpi.PathChoice(cuda_mpi.DIRECT, "MPIX_Query_cuda_support() = 1")


def _check_comm(values: dict) -> dict:
    """The schema's checks of a `comm` section: each key's, then the rule between them."""
    comm = schema.complete({"comm": values})["comm"]
    for key in schema.keys_of("comm"):
        key.validate(comm[key.name])
    schema.RULES["comm"](comm)
    return comm


def _shape(path) -> str:
    """A built path as nested class names and its logged path."""
    inner = [getattr(path, a) for a in ("inner", "on_device", "single_rank") if hasattr(path, a)]
    return type(path).__name__ + "".join(f"[{_shape(p)}]" for p in inner) + f"<{path.path}>"


# ---- the codec -----------------------------------------------------------------------------

def _mixed(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))).astype(np.float32)
    x[:6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-42]
    return x


@pytest.mark.parametrize("name", wire.WIRE_DTYPES)
def test_a_codec_codes_as_the_wire_functions_do(name):
    codec = codecs.CODECS[name]
    assert codec.name == name and wire.UNIT_ROUNDOFF[name] == codec.unit_roundoff
    x = _mixed(1001, 1)
    words = np.empty(codec.words(x.size), np.uint16)
    codec.encode(x, words)
    old = np.empty(wire.block_words(x.size), np.uint16)
    wire.pack_block(x, name, old)
    np.testing.assert_array_equal(words, old)
    np.testing.assert_array_equal(codec.decode(words).view(np.uint32), wire.unpack_block(old, name).view(np.uint32))


@pytest.mark.parametrize("name", wire.WIRE_DTYPES)
def test_a_codec_adds_decoded_blocks_in_float32_in_order(name):
    codec = codecs.CODECS[name]
    blocks = []
    for seed in range(4):
        x = (np.random.default_rng(seed).standard_normal(300) * 10.0 ** seed).astype(np.float32)
        blocks.append(np.empty(codec.words(x.size), np.uint16))
        codec.encode(x, blocks[-1])
    total = codec.sum_blocks(blocks, 300)
    expect = np.zeros(300, np.float32)
    for b in blocks:
        expect += codec.decode(b)
    assert total.dtype == np.float32
    np.testing.assert_array_equal(total.view(np.uint32), expect.view(np.uint32))
    assert codec.sum_blocks([], 0).size == 0


def test_codec_for_reads_the_wire_setting():
    assert codecs.codec_for(None) is None and codecs.codec_for("fp32") is None
    assert codecs.codec_for("bf16") is codecs.CODECS["bfloat16"]
    assert codecs.codec_for("half") is codecs.CODECS["float16"]
    with pytest.raises(ConfigError, match="comm.wire_dtype must be null, bfloat16 or float16; got 'int8'"):
        codecs.codec_for("int8")
    with pytest.raises(ValueError, match="unknown wire codec 'int8'"):
        wire.pack_block(np.ones(2, np.float32), "int8", np.empty(4, np.uint16))


# ---- the registry ----------------------------------------------------------------------------

def test_every_registered_path_declares_its_name():
    assert set(registry.REDUCTIONS) >= {"host", "ordered", "wire"}
    for name, path in registry.REDUCTIONS.items():
        assert path.name == name
    assert registry.choices()[0] == "auto"


@pytest.mark.parametrize("deterministic,wire_dtype,choice,expect", [
    (False, None, None, "HostSum<host>"),
    (True, None, None, "OrderedSum<host>"),
    (False, "bfloat16", None, "WireSum[HostSum<host>]<host, wire bfloat16>"),
    (True, "float16", None, "WireSum[OrderedSum<host>]<host, wire float16>"),
    (False, None, HOST, "HostSum<host>"),
    (False, None, STAGED, "StagedSum[HostSum<staged>]<staged>"),
    (True, None, STAGED, "StagedSum[OrderedSum<staged>]<staged>"),
    (False, "bfloat16", STAGED, "StagedSum[WireSum[HostSum<staged>]<staged, wire bfloat16>]<staged, wire bfloat16>"),
    (False, None, DIRECT, "CudaDirectSum[HostSum<cuda-aware>]<cuda-aware>"),
])
def test_auto_builds_the_path_the_settings_always_built(deterministic, wire_dtype, choice, expect):
    built = registry.make_reduction(1000, deterministic, wire_dtype, choice)
    assert _shape(built) == expect
    named = registry.make_reduction(1000, deterministic, wire_dtype, choice,
                                    name=registry.path_class("auto", deterministic,
                                                             codecs.codec_for(wire_dtype)).name)
    assert _shape(named) == expect


def test_a_direct_bucket_keeps_its_twin_on_the_host_path():
    built = registry.make_reduction(1000, False, None, DIRECT)
    assert _shape(built.on_host) == "HostSum<staged>"


@pytest.mark.parametrize("name,deterministic,wire_dtype,message", [
    ("host", True, None, "comm.reduction=host does not add in a fixed order, which comm.deterministic=true needs"),
    ("ordered", False, "bfloat16", "comm.reduction=ordered has no 16-bit wire, which comm.wire_dtype=bfloat16 asks for"),
    ("host", False, "fp16", "comm.reduction=host has no 16-bit wire, which comm.wire_dtype=float16 asks for"),
    ("wire", False, None, "comm.reduction=wire needs a 16-bit wire: set comm.wire_dtype"),
    ("nonsense", False, None, "comm.reduction='nonsense' is not one of ('auto', 'host', 'ordered', 'wire'"),
])
def test_a_named_path_that_cannot_serve_the_settings_is_refused(name, deterministic, wire_dtype, message):
    with pytest.raises(ConfigError) as info:
        registry.make_reduction(1000, deterministic, wire_dtype, name=name)
    assert message in str(info.value)
    with pytest.raises(ConfigError) as info:
        FusedBucket(10, ("samples",), np.float32, deterministic=deterministic, wire_dtype=wire_dtype,
                    reduction=name)
    assert message in str(info.value)
    with pytest.raises(ConfigError) as info:
        _check_comm({"reduction": name, "deterministic": deterministic, "wire_dtype": wire_dtype})
    assert "comm.reduction" in str(info.value) and "\n" not in str(info.value)


def test_the_schema_takes_every_registered_name():
    assert schema.default("comm.reduction") == "auto"
    for name in ("auto", "host", "ordered"):
        assert _check_comm({"reduction": name})["reduction"] == name
    assert _check_comm({"reduction": "wire", "wire_dtype": "bf16"})["reduction"] == "wire"
    assert _check_comm({"reduction": "ordered", "deterministic": True})["reduction"] == "ordered"
    assert _check_comm({"reduction": "wire", "wire_dtype": "float16", "deterministic": True})


def test_a_path_that_sums_host_memory_stages_a_device_bucket():
    assert registry.placement("host", False, None, DIRECT) is DIRECT
    assert registry.placement("auto", False, None, DIRECT) is DIRECT
    staged = registry.placement("ordered", False, None, DIRECT)
    assert staged.path == cuda_mpi.STAGED and staged.reason == "comm.reduction=ordered sums in host memory"
    assert registry.placement("ordered", False, None, HOST) is HOST
    built = registry.make_reduction(1000, False, None, DIRECT, name="ordered")
    assert _shape(built) == "StagedSum[OrderedSum<staged>]<staged>"


def test_the_bucket_names_a_named_path_and_nothing_else_changes():
    plain = FusedBucket(10, ("samples",), np.float32)
    plain.set_choice(HOST)
    assert plain.describe() == "bucket on host, path host (no GPU lane on this rank)"
    named = FusedBucket(10, ("samples",), np.float32, reduction="ordered")
    named.set_choice(HOST)
    assert named.describe() == "bucket on host, path host (no GPU lane on this rank), reduction ordered"
    assert named.reduction.ordered and not named.reduction.overlappable
    assert _shape(named.exact_reduction()) == "OrderedSum<host>"
    wired = FusedBucket(10, ("samples",), np.float32, wire_dtype="bf16", reduction="wire")
    assert not wired.reduction.exact and _shape(wired.exact_reduction()) == "HostSum<host>"
    host = FusedBucket(10, ("samples",), np.float32, reduction="host")
    assert host.reduction.overlappable and _shape(host.exact_reduction()) == "HostSum<host>"


# ---- under mpirun ------------------------------------------------------------------------------

WORKER = r'''
import hashlib, json, sys
import numpy as np
from mpi4py import MPI
from hpc_rlx.comm.collective import FusedBucket
comm = MPI.COMM_WORLD
n, cap_mb = 20_011, 0.02
cases = json.loads(sys.argv[1])
out = {}
for label, (auto, named) in cases.items():
    digests = []
    for kwargs in (auto, named):
        bucket = FusedBucket(n, ("samples", "loss_sum"), np.float32, cap_mb=cap_mb, **kwargs)
        rng = np.random.default_rng(7 + comm.rank)
        bucket.payload[...] = rng.standard_normal(n) * np.exp(rng.uniform(-8, 8, n))
        bucket["samples"], bucket["loss_sum"] = 1_000_003 + comm.rank, 0.1 * (comm.rank + 1)
        bucket.allreduce(comm)
        digests.append(hashlib.sha256(bucket.buffer.tobytes()).hexdigest())
    everywhere = comm.allgather(digests)
    out[label] = {"same_as_auto": digests[0] == digests[1],
                  "same_everywhere": all(d == everywhere[0] for d in everywhere)}
if comm.rank == 0:
    print("RESULT " + json.dumps(out))
'''

CASES = {
    "host": ({}, {"reduction": "host"}),
    "ordered": ({"deterministic": True}, {"deterministic": True, "reduction": "ordered"}),
    "wire bfloat16": ({"wire_dtype": "bfloat16"}, {"wire_dtype": "bfloat16", "reduction": "wire"}),
    "wire float16, deterministic": ({"wire_dtype": "float16", "deterministic": True},
                                    {"wire_dtype": "float16", "deterministic": True, "reduction": "wire"}),
    "ordered without deterministic": ({"deterministic": True}, {"reduction": "ordered"}),
}


@pytest.mark.mpi
def test_a_named_path_sums_bit_for_bit_as_its_auto_twin(tmp_path):
    script = tmp_path / "reduction_worker.py"
    script.write_text(WORKER)
    proc = mpirun(3, [str(script), json.dumps(CASES)], timeout=120, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, explain(proc)
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert set(res) == set(CASES)
    for label, r in res.items():
        assert r["same_as_auto"] and r["same_everywhere"], (label, r)


@pytest.mark.mpi
@pytest.mark.parametrize("overrides,message", [
    (["comm.reduction=nonsense"], "comm.reduction='nonsense' is not one of ('auto', 'host', 'ordered', 'wire')"),
    (["comm.reduction=host", "comm.deterministic=true"],
     "comm.reduction=host does not add in a fixed order, which comm.deterministic=true needs"),
])
def test_a_bad_reduction_is_one_clear_error_on_every_rank(tmp_path, digits_h5, overrides, message):
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", *overrides], timeout=60)
    assert proc.returncode == 2, explain(proc)          # the agreed-error exit: every rank raised it
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1 and errors[0].startswith("hpc_rlx: error (ConfigError, "), explain(proc)
    assert message in proc.stderr, explain(proc)
    assert "Traceback" not in proc.stderr and "aborting all" not in proc.stderr, explain(proc)


@pytest.mark.mpi
def test_training_with_a_named_path_logs_it(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", [f"data.path={digits_h5}", "train.epochs=2", "checkpoint=off",
                                           "comm.reduction=ordered"])
    assert proc.returncode == 0, explain(proc)
    assert "reduction ordered; shared-memory sum off: comm.reduction=ordered" in proc.stdout, explain(proc)
