"""Every optimizer, by the name `optim=NAME` selects. A new optimizer is one module, one line
here and its `configs/optim/NAME.yaml`: the config schema, the spec's checks and the memory
estimate read its declaration (`base.Optimizer`)."""

from __future__ import annotations

import numpy as np

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.optim.adamw import AdamW
from hpc_rlx.optim.base import Optimizer
from hpc_rlx.optim.lamb import LAMB
from hpc_rlx.optim.lars import LARS
from hpc_rlx.optim.lion import Lion
from hpc_rlx.optim.sgd import SGD

OPTIMIZERS: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adamw": AdamW,
    "lion": Lion,
    "lamb": LAMB,
    "lars": LARS,
}


def make_optimizer(name: str, size: int, xp, dtype, **kwargs) -> Optimizer:
    """Build optimizer ``name`` over ``size`` flat parameters; unknown names and keys raise."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    takes = [h.name for h in OPTIMIZERS[name].hyper]
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        raise ConfigError(f"optimizer {name!r} does not take {unknown}; it takes {takes}")
    return OPTIMIZERS[name](size, xp, dtype, **kwargs)


def optimizer_kwargs(section: dict) -> dict:
    """The chosen optimizer's own arguments from a (completed) `optim` section; the section's
    other keys are the schedule's and the learning rate's."""
    return {h.name: h.to_arg(section[h.name]) for h in OPTIMIZERS[section["name"]].hyper}


def parameter_copies(section: dict) -> int:
    """Parameter-sized arrays the optimizer of a (completed) `optim` section holds, state and
    scratch: measured on a one-parameter instance, so the estimate is the code's own count."""
    built = make_optimizer(section["name"], 1, np, np.float64, **optimizer_kwargs(section))
    return built.nbytes() // np.dtype(np.float64).itemsize
