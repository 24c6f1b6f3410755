"""Parameter groups: `optim.no_decay` and `optim.lr_mult` as per-parameter settings, and the
runs of the optimizer's flat array they cut it into. Pure: no arrays, no MPI.

A parameter is selected by the name a user knows it by (its PyTorch state-dict key for an
imported ONNX model, its name in `model.h5` otherwise: `graph/param_names.py`), with shell-style
globs (`fnmatch`, case-sensitive: `*bias`, `classifier.*`, `*.LayerNorm.weight`).

- ``no_decay``: the parameters matched by any glob get no weight decay. With LAMB and LARS they
  also keep a trust ratio of 1, as MLPerf's LARS and TensorFlow's LAMB and LARS treat the
  parameters excluded from weight decay (their ``exclude_from_layer_adaptation`` defaults to
  the same list).
- ``lr_mult``: ``{glob: factor}``; a parameter takes the factor of the first glob, in the order
  written, that matches it (1 if none): its learning rate is the schedule's times the factor,
  as a PyTorch parameter group whose ``lr`` is the base one times the factor. AdamW's and Lion's
  decoupled weight decay scale with that learning rate, as in PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Mapping, Sequence

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph.param_names import unmatched_glob

__all__ = ["ParamSetting", "DEFAULT", "settings_for", "runs", "check_group_keys"]


@dataclass(frozen=True)
class ParamSetting:
    lr_mult: float = 1.0
    decay: bool = True


DEFAULT = ParamSetting()


def check_group_keys(no_decay, lr_mult) -> None:
    """The two keys' types and factors (ConfigError naming the key)."""
    if not isinstance(no_decay, (list, tuple)) or not all(isinstance(g, str) and g for g in no_decay):
        raise ConfigError(f"optim.no_decay must be a list of parameter-name globs, got {no_decay!r}")
    if not isinstance(lr_mult, Mapping):
        raise ConfigError(f"optim.lr_mult must be a mapping {{glob: factor}}, got {lr_mult!r}")
    for glob, factor in lr_mult.items():
        if not isinstance(glob, str) or not glob:
            raise ConfigError(f"optim.lr_mult: {glob!r} is not a parameter-name glob")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor < 0:
            raise ConfigError(f"optim.lr_mult: the factor of {glob!r} must be a finite number >= 0, got {factor!r}")


def settings_for(names: Sequence[str], no_decay: Sequence[str] = (),
                 lr_mult: Mapping[str, float] | None = None, every_glob_matches: bool = True) -> list[ParamSetting]:
    """Each trainable parameter's setting, by its user-facing name. ``every_glob_matches``: a
    glob that matches none of them is one ConfigError naming the closest names (rank 0 checks
    the whole model; a pipeline stage holds only some of its parameters)."""
    check_group_keys(no_decay, lr_mult or {})
    lr_mult = dict(lr_mult or {})
    for key, globs in (("optim.no_decay", no_decay), ("optim.lr_mult", list(lr_mult))):
        for glob in globs if every_glob_matches else ():
            if not any(fnmatchcase(n, glob) for n in names):
                raise unmatched_glob(key, glob, names)
    out = []
    for n in names:
        factor = next((float(f) for g, f in lr_mult.items() if fnmatchcase(n, g)), 1.0)
        out.append(ParamSetting(factor, not any(fnmatchcase(n, g) for g in no_decay)))
    return out


def runs(segments, settings: Sequence[ParamSetting]) -> list[tuple[int, int, ParamSetting]]:
    """The optimizer's array as [lo, hi) runs of one setting each, adjacent segments of equal
    settings merged (``settings`` by the segments' parameter ``index``)."""
    out: list[tuple[int, int, ParamSetting]] = []
    for seg in segments:
        s = settings[seg.index]
        if out and out[-1][2] == s and out[-1][1] == seg.start:
            out[-1] = (out[-1][0], seg.stop, s)
        else:
            out.append((seg.start, seg.stop, s))
    return out
