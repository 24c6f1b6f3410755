"""Every reduction path, by the name ``comm.reduction=NAME`` selects. A new path is one module
defining a `reduce.ReductionPath` subclass (its `name`, what it can do, `build`) and one line
here; the config schema takes the names from this table.

``comm.reduction=auto`` (the default) picks the path from the other settings: the 16-bit wire
when ``comm.wire_dtype`` is set, else the ordered sum under ``comm.deterministic=true``, else
MPI's SUM. A named path that cannot serve the settings (an unordered path under
``comm.deterministic=true``, a path without a codec under ``comm.wire_dtype``, the wire
without one) is refused with a `ConfigError` naming ``comm.reduction``. Where the path runs
(the lanes' `cuda_mpi.PathChoice`) is a placement around it: a device bucket is summed on the
device (`reduce.CudaDirectSum`) by a path that can (`ReductionPath.sums_on_device`), else staged
through its host side (`reduce.StagedSum`).

Under ``comm.shard=optimizer`` ``auto`` is the built-in reduce-scatter (`shard.ScatteredSum`), and
a named path must be one for the sharded step (`ReductionPath.gathers_params`: it sums this
rank's slice and gathers the parameters its own way); such a path serves nothing else.
"""

from __future__ import annotations

from dataclasses import replace

from hpc_rlx.comm.codec import Codec, codec_for
from hpc_rlx.comm.reduce import CudaDirectSum, HostSum, OrderedSum, ReductionPath, Request, StagedSum, WireSum
from hpc_rlx.comm.shard import ScatteredSum
from hpc_rlx.base import cuda_mpi
from hpc_rlx.base.errors import ConfigError

REDUCTIONS: dict[str, type[ReductionPath]] = {
    "host": HostSum,
    "ordered": OrderedSum,
    "wire": WireSum,
}

AUTO = "auto"


def choices() -> tuple[str, ...]:
    """The values ``comm.reduction`` takes."""
    return (AUTO, *REDUCTIONS)


def _auto(deterministic: bool, codec: Codec | None) -> str:
    return "wire" if codec is not None else "ordered" if deterministic else "host"


def refusal(path: type[ReductionPath], deterministic: bool, codec: Codec | None,
            sharded: bool = False) -> str | None:
    """Why ``path`` cannot serve these settings, in words; None when it can. (A path that does
    not gather under ``sharded`` is `sharded_refusal`'s to refuse.)"""
    if path.gathers_params and not sharded:
        return "sums a sharded optimizer's slices, which needs comm.shard=optimizer"
    if deterministic and not path.ordered:
        return "does not add in a fixed order, which comm.deterministic=true needs"
    if codec is not None and not path.takes_codec:
        return f"has no 16-bit wire, which comm.wire_dtype={codec.name} asks for"
    if codec is None and path.needs_codec:
        return "needs a 16-bit wire: set comm.wire_dtype (bfloat16 or float16)"
    return None


def path_class(name: str, deterministic: bool, codec: Codec | None, sharded: bool = False) -> type[ReductionPath]:
    """The registered class ``comm.reduction=name`` selects for these settings; a
    `ConfigError` naming the key when there is none or it cannot serve them."""
    if name is None or name == AUTO:
        return ScatteredSum if sharded else REDUCTIONS[_auto(deterministic, codec)]
    path = REDUCTIONS.get(name) if isinstance(name, str) else None
    if path is None:
        raise ConfigError(f"comm.reduction={name!r} is not one of {choices()}")
    why = sharded_refusal(name) if sharded else None
    if why is not None:
        raise ConfigError(f"comm.shard=optimizer does not run with {why}")
    why = refusal(path, deterministic, codec, sharded)
    if why is not None:
        raise ConfigError(f"comm.reduction={name} {why}")
    return path


def sharded_refusal(name) -> str | None:
    """Why ``comm.shard=optimizer`` does not run with ``comm.reduction=name`` (a path that does
    not gather the parameters), in words; None when it does."""
    path = REDUCTIONS.get(name) if isinstance(name, str) else None
    if name is None or name == AUTO or path is None or path.gathers_params:
        return None
    return f"comm.reduction={name}: the reduce-scatter is the sharded step's own path"


def check_settings(name, deterministic: bool, wire_dtype, shard: str = "none") -> None:
    """The schema's check of ``comm.reduction`` against the other ``comm.*`` settings (a path
    that does not gather under ``comm.shard=optimizer``: `config.sharding.check_shard`)."""
    sharded = shard == "optimizer"
    if name is not None and name != AUTO and (not sharded or sharded_refusal(name) is None):
        path_class(name, bool(deterministic), codec_for(wire_dtype), sharded)


def exact_name(name: str) -> str:
    """The name of the exact path for a use that must sum the host array as it is: the
    selected path when it is exact, runs without a codec and sums the whole array (not a
    sharded step's slice), else `AUTO`."""
    path = REDUCTIONS.get(name)
    whole = path is not None and path.exact and not path.needs_codec and not path.gathers_params
    return name if whole else AUTO


def placement(name: str, deterministic: bool, codec: Codec | None,
              choice: cuda_mpi.PathChoice) -> cuda_mpi.PathChoice:
    """The lanes' choice, with a device bucket staged when the path cannot sum device memory."""
    if choice.path != cuda_mpi.DIRECT or path_class(name, deterministic, codec).sums_on_device:
        return choice
    return cuda_mpi.PathChoice(cuda_mpi.STAGED, f"comm.reduction={name} sums in host memory")


def make_reduction(chunk_elems: int, deterministic: bool, wire: str | None,
                   choice: cuda_mpi.PathChoice | None = None, name: str = AUTO) -> ReductionPath:
    """The bucket's reduction path for this rank's settings and lane placement (``choice``:
    None or HOST for a host bucket, STAGED or DIRECT for a bucket with a device twin)."""
    codec = codec_for(wire)
    path = path_class(name, deterministic, codec)
    where = choice.path if choice is not None else cuda_mpi.HOST
    request = Request(chunk_elems, where, deterministic, codec)
    if where == cuda_mpi.DIRECT and path.sums_on_device:
        return CudaDirectSum(path.build(request), path.build(replace(request, where=cuda_mpi.STAGED)))
    if where == cuda_mpi.HOST:
        return path.build(request)
    return StagedSum(path.build(replace(request, where=cuda_mpi.STAGED)))
