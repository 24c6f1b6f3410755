"""`path_choice`: the one function that picks the bucket's reduction path from the settings,
the lanes' placement and the memory's home, and what the paths declare they can do (pure:
the paths are built, never run)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.comm import reduce, registry
from hpc_rlx.comm.bucket_layout import BucketLayout
from hpc_rlx.comm.bucket_memory import BucketMemory
from hpc_rlx.comm.codec import codec_for
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.comm.feedback_wire import FeedbackWireSum
from hpc_rlx.comm.node_memory import NodeSharedSum
from hpc_rlx.comm.node_scatter import NodeScatteredSum
from hpc_rlx.comm.path_choice import (ReductionSettings, choose_reduction, exact_path, placement_for,
                                      shared_memory_refusal)
from hpc_rlx.comm.shard import ParamShard, ScatteredSum
from hpc_rlx.base import cuda_mpi
from hpc_rlx.base.errors import HpcRlxError

HOST = cuda_mpi.PathChoice(cuda_mpi.HOST, "no GPU lane on this rank")
STAGED = cuda_mpi.PathChoice(cuda_mpi.STAGED, "MPI is not known to be CUDA-aware")
DIRECT = cuda_mpi.PathChoice(cuda_mpi.DIRECT, "MPIX_Query_cuda_support() = 1")
SHARD = ParamShard(100, 90, rank=1, world=4)


def _shape(path) -> str:
    """A built path as nested class names (the wrapped path in brackets)."""
    inner = path.inner if isinstance(path, reduce.StagedSum) else \
        path.on_device if isinstance(path, reduce.CudaDirectSum) else None
    return type(path).__name__ + (f"[{_shape(inner)}]" if inner is not None else "")


class SharedWindow:
    """What the memory sees of the node's shared window: this rank's segment of it (no MPI)."""

    in_node_memory = True
    overlappable = False

    def __init__(self, size: int):
        self.segment = np.zeros(size, np.float32)


@pytest.mark.parametrize("settings,where,expected", [
    (ReductionSettings(1000), None, "HostSum"),
    (ReductionSettings(1000), HOST, "HostSum"),
    (ReductionSettings(1000, deterministic=True), HOST, "OrderedSum"),
    (ReductionSettings(1000, wire="bfloat16"), HOST, "WireSum"),
    (ReductionSettings(1000), DIRECT, "CudaDirectSum[HostSum]"),
    (ReductionSettings(1000), STAGED, "StagedSum[HostSum]"),
    (ReductionSettings(1000, reduction_name="ordered"), STAGED, "StagedSum[OrderedSum]"),
    (ReductionSettings(1000, shard=SHARD), None, "ScatteredSum"),
    (ReductionSettings(1000, shard=SHARD), HOST, "ScatteredSum"),
    (ReductionSettings(1000, shard=SHARD), STAGED, "StagedSum[ScatteredSum]"),
])
def test_the_settings_and_the_placement_choose_the_path(settings, where, expected):
    path = choose_reduction(settings, where, None)
    assert _shape(path) == expected
    assert path.gathers_params == (settings.shard is not None)     # the sharded paths gather


def test_the_node_window_is_the_path_of_a_host_bucket_only():
    window = SharedWindow(10)
    for settings in (ReductionSettings(1000), ReductionSettings(1000, shard=SHARD)):
        assert choose_reduction(settings, None, window) is window
        assert choose_reduction(settings, HOST, window) is window
        assert choose_reduction(settings, STAGED, window) is not window
    assert exact_path(ReductionSettings(1000, wire="float16"), window) is window


def test_the_sharded_path_carries_the_codec_and_the_node_parameters():
    node_params = object()      # where the parameters are gathered (comm.node_shared_params)
    path = choose_reduction(ReductionSettings(1000, wire="float16", shard=SHARD, shared_params=node_params),
                            None, None)
    assert path.codec is codec_for("float16") and not path.exact and path.shared_params is node_params
    staged = choose_reduction(ReductionSettings(1000, shard=SHARD), STAGED, None)
    assert staged.gathers_params and staged.inner.shard is SHARD


def test_a_device_bucket_is_staged_where_its_path_sums_host_memory():
    sharded = placement_for(ReductionSettings(1000, shard=SHARD), DIRECT)
    assert sharded.path == cuda_mpi.STAGED and sharded.reason == "comm.shard=optimizer sums in host memory"
    assert placement_for(ReductionSettings(1000, shard=SHARD), HOST) is HOST
    assert placement_for(ReductionSettings(1000), DIRECT) is DIRECT
    ordered = placement_for(ReductionSettings(1000, reduction_name="ordered"), DIRECT)
    assert ordered.path == cuda_mpi.STAGED and ordered.reason == "comm.reduction=ordered sums in host memory"


@pytest.mark.parametrize("settings,kwargs,reason", [
    (ReductionSettings(1000), {}, None),
    (ReductionSettings(1000), {"cpu_only": False}, "a GPU lane"),
    (ReductionSettings(1000), {"on_device": True}, "a GPU lane"),
    (ReductionSettings(1000, deterministic=True), {}, "comm.deterministic=true"),
    (ReductionSettings(1000, deterministic=True, shard=SHARD), {}, None),
    (ReductionSettings(1000, wire="bfloat16"), {}, "comm.wire_dtype=bfloat16"),
    (ReductionSettings(1000), {"overlap": True}, "comm.overlap=true"),
    (ReductionSettings(1000, reduction_name="host"), {}, "comm.reduction=host"),
])
def test_why_the_node_memory_cannot_sum_the_bucket(settings, kwargs, reason):
    args = dict(cpu_only=True, on_device=False, overlap=False) | kwargs
    assert shared_memory_refusal(settings, choose_reduction(settings, None, None), **args) == reason


def test_paths_declare_what_they_can_do():
    for path in registry.REDUCTIONS.values():
        assert not path.gathers_params and not path.keeps_state_by_index, path
    assert ScatteredSum.gathers_params and NodeScatteredSum.gathers_params and not NodeSharedSum.gathers_params
    assert FeedbackWireSum.keeps_state_by_index and not reduce.WireSum.keeps_state_by_index
    with pytest.raises(NotImplementedError, match="HostSum does not gather parameters"):
        reduce.HostSum(10).gather_params(None, np.zeros(4))


def test_an_unsharded_bucket_does_not_gather_parameters():
    bucket = FusedBucket(10, ("samples",), np.float32)
    with pytest.raises(HpcRlxError, match=r"the bucket's path \(host\) does not gather parameters"):
        bucket.gather_params(None, np.zeros(10, np.float32))
    assert bucket.sent.sent == 0


def test_the_bucket_chooses_again_when_its_memory_or_the_world_changes():
    bucket = FusedBucket(6, ("samples",), np.float32, rank_fields=("steps",), world_size=3)
    first = bucket.reduction
    bucket.set_choice(STAGED)
    assert _shape(bucket.reduction) == "StagedSum[HostSum]" and bucket.choice is STAGED
    bucket.set_choice(HOST)
    assert _shape(bucket.reduction) == "HostSum" and bucket.reduction is not first
    placed = bucket.reduction
    assert not bucket.world_changed(2) and bucket.layout.world_size == 2
    assert _shape(bucket.reduction) == "HostSum" and bucket.reduction is not placed


def test_the_memory_moves_into_a_window_and_out_with_its_values():
    memory = BucketMemory(BucketLayout(4, ("samples",), ("steps",), world_size=2), np.float32)
    memory.payload[...] = [1, 2, 3, 4]
    memory["samples"] = 5.0
    memory.put("steps", 7.0, 1)
    window = SharedWindow(memory.buffer.size)
    memory.share(window)
    assert memory.window is window and memory.buffer is window.segment
    assert list(memory.payload) == [1, 2, 3, 4] and memory["samples"] == 5.0
    memory.leave_window(copy=False)             # abandoned: the segment stays the buffer
    assert memory.window is None and memory.buffer is window.segment
    memory.share(window)
    memory.leave_window(copy=True)              # freed: a private copy of the last values
    assert memory.buffer is not window.segment and not np.shares_memory(memory.buffer, window.segment)
    assert np.array_equal(memory.buffer, window.segment) and list(memory["steps"]) == [0.0, 7.0]
    assert memory.payload_finite()
    memory.payload[2] = np.nan
    assert not memory.payload_finite()
    with pytest.raises(HpcRlxError, match="without a device twin"):
        memory.mark_device_fresh()


def test_the_bucket_declares_what_a_step_reads_and_forwards_nothing_else():
    """The layout, the host arrays and the named fields are the bucket's own surface (read live
    from its memory, which moves its arrays); the device twin, the transfers and the settings
    are read where they live, `bucket.memory` and `bucket.settings`."""
    bucket = FusedBucket(4, ("samples",), np.float64, cap_mb=1e-4, deterministic=True, shard=SHARD)
    assert bucket.buffer is bucket.memory.buffer and bucket.layout is bucket.memory.layout
    assert bucket.payload is bucket.memory.payload and bucket.tail is bucket.memory.tail
    view = bucket.payload
    bucket.payload += 2.0       # in place, as a policy divides it
    assert bucket.payload is view and np.all(view == 2.0)
    with pytest.raises(AttributeError, match="written in place"):
        bucket.payload = np.zeros(4)
    bucket.zero_tail()
    bucket.put("samples", 3.0, 0)
    assert bucket["samples"] == 3.0 == bucket.memory["samples"]
    settings = bucket.settings
    assert settings.chunk_elems == 13 and settings.deterministic and settings.shard is SHARD and settings.wire is None
    assert bucket.communicators == ()
    for name in ("chunk_elems", "deterministic", "shard", "payload_to_host", "device_payload", "nothing"):
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(bucket, name)


class GathersByBcast(ScatteredSum):
    """A sharded step's path registered by name (no MPI here: built, never run)."""

    name = "gathers"


def test_a_named_path_that_gathers_is_the_sharded_steps_path(monkeypatch):
    from hpc_rlx.config.sharding import check_shard
    from hpc_rlx.base.errors import ConfigError
    monkeypatch.setitem(registry.REDUCTIONS, "gathers", GathersByBcast)
    node_params = object()
    settings = ReductionSettings(1000, wire="bfloat16", reduction_name="gathers", shard=SHARD,
                                 shared_params=node_params)
    path = choose_reduction(settings, HOST, None)
    assert _shape(path) == "GathersByBcast" and path.shard is SHARD and path.shared_params is node_params
    assert path.codec is codec_for("bfloat16") and path.chunk_elems == 1000
    assert _shape(choose_reduction(settings, STAGED, None)) == "StagedSum[GathersByBcast]"
    assert registry.path_class("auto", False, None, sharded=True) is ScatteredSum
    # it serves nothing but the sharded step; a path that does not gather, not that
    message = "comm.reduction=gathers sums a sharded optimizer's slices, which needs comm.shard=optimizer"
    with pytest.raises(ConfigError, match=message):
        choose_reduction(ReductionSettings(1000, reduction_name="gathers"), HOST, None)
    with pytest.raises(ConfigError, match=message):
        registry.check_settings("gathers", False, None, "none")
    registry.check_settings("gathers", True, "float16", "optimizer")
    with pytest.raises(ConfigError, match="comm.shard=optimizer does not run with comm.reduction=host: "
                                          "the reduce-scatter is the sharded step's own path"):
        choose_reduction(ReductionSettings(1000, reduction_name="host", shard=SHARD), HOST, None)
    registry.check_settings("host", False, None, "optimizer")     # check_shard's to refuse, as before
    assert registry.exact_name("gathers") == "auto" and registry.exact_name("ordered") == "ordered"
    cfg = {"comm": {"shard": "optimizer", "reduction": "gathers", "node_shared_params": False},
           "policy": {"name": "sync"}, "parallel": {"pipeline_stages": 1}, "device": {"kind": "cpu"}}
    check_shard(cfg)
    with pytest.raises(ConfigError, match="comm.shard=optimizer does not run with comm.reduction=host"):
        check_shard({**cfg, "comm": dict(cfg["comm"], reduction="host")})
    with pytest.raises(ConfigError, match="comm.node_shared_params=true does not run with comm.reduction=gathers: "
                                          "a named path gathers the parameters its own way"):
        check_shard({**cfg, "comm": dict(cfg["comm"], node_shared_params=True)})
