"""Optimizers, learning-rate schedules and gradient clipping: pure array math on flat parameter
and gradient arrays (NumPy or CuPy), no MPI and no I/O.

`registry.OPTIMIZERS` lists the optimizers; each declares its own config keys (`base.Optimizer`).
"""

from hpc_rlx.optim.clip import clip_grad_norm_
from hpc_rlx.optim.groups import settings_for
from hpc_rlx.optim.registry import OPTIMIZERS, make_optimizer, optimizer_kwargs, parameter_copies
from hpc_rlx.optim.schedules import LR_SCHEDULES, Schedule, make_schedule, scaled_lr

__all__ = ["OPTIMIZERS", "LR_SCHEDULES", "Schedule", "clip_grad_norm_", "make_optimizer", "make_schedule",
           "optimizer_kwargs", "parameter_copies", "scaled_lr", "settings_for"]
