"""Which reduction path sums the fused bucket: one function, `choose_reduction`, asked again
whenever the bucket's memory or the world changes (the lanes place it, it moves into or out of
the node's shared window, a failure shrank the job).

The answer follows from three things only:

- the run's settings (`ReductionSettings`: ``comm.bucket_cap_mb``, ``comm.deterministic``,
  ``comm.wire_dtype``, ``comm.reduction``, ``comm.shard`` and ``comm.node_shared_params``),
  fixed for the run;
- where the lanes placed the bucket (`cuda_mpi.PathChoice`, as `placement_for` adjusts it:
  None or HOST for a host bucket, STAGED or DIRECT for one with a device twin);
- whether the bucket's memory lives in the node's shared window (`node_memory`), which is
  then the path of a host bucket.

Pure: no MPI (the paths it builds call MPI when they run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_rlx.comm.codec import codec_for, normalize_wire
from hpc_rlx.comm.reduce import ReductionPath, Request, StagedSum
from hpc_rlx.comm.registry import AUTO, exact_name, make_reduction, path_class, placement
from hpc_rlx.comm.shard import ParamShard
from hpc_rlx.base import cuda_mpi


@dataclass(frozen=True)
class ReductionSettings:
    """What the run asks of the bucket's sum; the same for the whole run."""

    chunk_elems: int                    # comm.bucket_cap_mb, in elements
    deterministic: bool = False         # comm.deterministic
    wire: str | None = None             # comm.wire_dtype, normalized (None: no 16-bit wire)
    reduction_name: str = AUTO          # comm.reduction
    shard: ParamShard | None = None     # comm.shard=optimizer: the payload is reduce-scattered
    shared_params: Any = None           # comm.node_shared_params: the node's one parameter array
                                        # (`node_params.NodeSharedParams`), which the sharded
                                        # paths gather into

    @classmethod
    def of(cls, chunk_elems: int, deterministic: bool, wire_dtype, reduction, shard, shared_params):
        return cls(int(chunk_elems), bool(deterministic), normalize_wire(wire_dtype),
                   AUTO if reduction is None else reduction, shard, shared_params)


def placement_for(settings: ReductionSettings, choice: cuda_mpi.PathChoice) -> cuda_mpi.PathChoice:
    """The lanes' choice, with a device bucket staged where the path sums host memory (the
    sharded reduce-scatter always does)."""
    if settings.shard is not None:
        return choice if choice.path == cuda_mpi.HOST else cuda_mpi.PathChoice(
            cuda_mpi.STAGED, "comm.shard=optimizer sums in host memory")
    return placement(settings.reduction_name, settings.deterministic, codec_for(settings.wire), choice)


def choose_reduction(settings: ReductionSettings, where: cuda_mpi.PathChoice | None,
                     window: ReductionPath | None) -> ReductionPath:
    """The bucket's reduction path for these settings, this placement (`placement_for`'s
    answer; None before the lanes placed the bucket) and the node's shared ``window`` the host
    array lives in (None: private memory)."""
    on_host = where is None or where.path == cuda_mpi.HOST
    if window is not None and on_host:
        return window           # the node's shared memory: the host path, summed there
    if settings.shard is None:
        return make_reduction(settings.chunk_elems, settings.deterministic, settings.wire, where,
                              name=settings.reduction_name)
    # the sharded step: the built-in reduce-scatter (auto) or a named path that gathers its own way
    codec = codec_for(settings.wire)
    path = path_class(settings.reduction_name, settings.deterministic, codec, sharded=True)
    scattered = path.build(Request(settings.chunk_elems, cuda_mpi.HOST, settings.deterministic, codec,
                                   settings.shard, settings.shared_params))
    return scattered if on_host else StagedSum(scattered)


def exact_path(settings: ReductionSettings, current: ReductionPath) -> ReductionPath:
    """The path of a use that must sum the host array as it is, whatever the step's path
    (16-bit wire, device twin): MPI's SUM, or the ordered sum under ``comm.deterministic``,
    chunked as the bucket is, or the node's shared memory when the bucket lives there
    (``current``, the bucket's path), or the path ``comm.reduction`` names when it is exact."""
    if current.in_node_memory:
        return current
    return make_reduction(settings.chunk_elems, settings.deterministic, None,
                          name=exact_name(settings.reduction_name))


def shared_memory_refusal(settings: ReductionSettings, current: ReductionPath, *, cpu_only: bool,
                          on_device: bool, overlap: bool) -> str | None:
    """Why this rank's bucket cannot be summed in the node's shared memory, in words (None: it
    can). Only a host bucket summed by MPI's SUM (not ordered, not the 16-bit wire, not
    overlapped, not a path ``comm.reduction`` names), or the sharded reduce-scatter."""
    sharded = settings.shard is not None
    return ("a GPU lane" if not cpu_only or on_device else
            "comm.deterministic=true" if settings.deterministic and not sharded else
            f"comm.wire_dtype={settings.wire}" if settings.wire else
            "comm.overlap=true" if overlap else
            f"comm.reduction={settings.reduction_name}" if settings.reduction_name != AUTO else
            None if sharded or current.overlappable else "a reduction other than MPI's SUM")
