"""Learning-rate schedules (constant, step, multistep, cosine; each with an optional linear
warm-up) and the linear scaling of the learning rate with the number of ranks.

The decays of `step` and `multistep` count optimizer steps from the end of the warm-up: a
milestone m decays the learning rate from step warmup_steps + m on (DeepCAM's reference
schedule, MultiStepLRWarmup, shifts its milestones past the warm-up alike)."""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Callable

from hpc_rlx.base.checks import Check, is_integral, is_real
from hpc_rlx.base.errors import ConfigError, check_param
from hpc_rlx.optim.base import AT_LEAST_ONE, COUNT, nonneg


LR_SCHEDULES = ("constant", "step", "multistep", "cosine")
IN_HALF_OPEN_UNIT = Check(lambda v: is_real(v) and 0.0 < float(v) <= 1.0, "must be a number in (0, 1]")   # gamma


class Schedule:
    """``lr = schedule(step)`` for a 0-based optimizer step; see :func:`make_schedule`."""

    def __init__(self, name, base_lr, total_steps, warmup_steps, step_size, gamma, min_lr, milestones=()):
        self.name = name
        self.milestones = tuple(milestones)
        self.base_lr = base_lr
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.step_size = step_size
        self.gamma = gamma
        self.min_lr = min_lr

    def __call__(self, step: int) -> float:
        if not (is_integral(step) and step >= 0):
            raise ValueError(f"schedule step must be an integer >= 0, got {step!r}")
        w = self.warmup_steps
        if step < w:
            # linear ramp that reaches base_lr on the last warmup step
            return self.base_lr * (step + 1) / w
        s = step - w
        if self.name == "constant":
            return self.base_lr
        if self.name == "step":
            return max(self.min_lr, self.base_lr * self.gamma ** (s // self.step_size))
        if self.name == "multistep":     # one decay for every milestone reached
            return max(self.min_lr, self.base_lr * self.gamma ** bisect_right(self.milestones, s))
        span = self.total_steps - w
        if s >= span:
            return self.min_lr
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * s / span))

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, base_lr={self.base_lr}, total_steps={self.total_steps}, "
            f"warmup_steps={self.warmup_steps}, step_size={self.step_size}, gamma={self.gamma}, "
            f"min_lr={self.min_lr}, milestones={list(self.milestones)})"
        )


def make_schedule(
    name: str,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    step_size: int | None = None,
    gamma: float = 0.1,
    min_lr: float = 0.0,
    milestones=(),
) -> Callable[[int], float]:
    """An LR schedule over 0-based steps, with an optional linear warmup in front.

    - warmup (any schedule): ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``;
    - "constant": ``base_lr``;
    - "step": ``base_lr * gamma ** ((step - warmup) // step_size)``, floored at ``min_lr``;
    - "multistep": ``base_lr * gamma ** k``, k the number of ``milestones`` <= ``step - warmup``
      (strictly increasing, >= 1, before the schedule's end), floored at ``min_lr``: torch's
      MultiStepLR shifted by the warm-up;
    - "cosine": from ``base_lr`` down to ``min_lr`` over the ``total_steps - warmup_steps`` steps
      after warmup, then held at ``min_lr`` (it does not rise again like torch's periodic form).
    """
    where = f"lr schedule {name!r}"
    if name not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr schedule {name!r}; choose one of {list(LR_SCHEDULES)}")
    base_lr = nonneg("base_lr", base_lr, where)
    min_lr = nonneg("min_lr", min_lr, where)
    total_steps = int(check_param(COUNT, "total_steps", total_steps, where))
    warmup_steps = int(check_param(COUNT, "warmup_steps", warmup_steps, where))
    if total_steps < 1:
        raise ConfigError.bad_param("total_steps", f" must be >= 1, got {total_steps}", where)
    if warmup_steps > total_steps:
        raise ConfigError.bad_param(
            "warmup_steps", f" ({warmup_steps}) is more than total_steps ({total_steps})", where)
    if name == "cosine" and warmup_steps >= total_steps:
        raise ConfigError.bad_param(
            "warmup_steps", f" ({warmup_steps}) leaves no steps to anneal over (total_steps={total_steps})",
            where)
    if name != "constant" and min_lr > base_lr:
        raise ConfigError.bad_param("min_lr", f" ({min_lr}) is above base_lr ({base_lr})", where)
    if name == "step":
        step_size = int(check_param(AT_LEAST_ONE, "step_size", step_size, where))
        check_param(IN_HALF_OPEN_UNIT, "gamma", gamma, where)
    if name == "multistep":
        check_param(IN_HALF_OPEN_UNIT, "gamma", gamma, where)
        milestones = _milestones(milestones, total_steps - warmup_steps, where)
    return Schedule(name, base_lr, total_steps, warmup_steps, step_size, float(gamma), min_lr,
                    milestones if name == "multistep" else ())


def _milestones(milestones, span: int, where: str) -> tuple[int, ...]:
    """`multistep`'s milestones: steps after the warm-up, strictly increasing, each inside the
    ``span`` steps the schedule has after it (a later one never decays: likely epochs, not steps)."""
    if not isinstance(milestones, (list, tuple)) or not milestones:
        raise ConfigError.bad_param("milestones", f" must be a non-empty list of steps after the warm-up, "
                                    f"got {milestones!r}", where)
    for i, m in enumerate(milestones):
        check_param(AT_LEAST_ONE, "milestones", m, where, f"[{i}]")
        if i and m <= milestones[i - 1]:
            raise ConfigError.bad_param("milestones", f" must be strictly increasing, got {list(milestones)}", where)
    if milestones[-1] >= span:
        raise ConfigError.bad_param(
            "milestones", f"[{len(milestones) - 1}] ({milestones[-1]}) is not before the schedule's end: "
            f"{span} steps follow the warm-up (milestones count optimizer steps after it)", where)
    return tuple(int(m) for m in milestones)


def scaled_lr(lr: float, world_size: int, ratio: float) -> float:
    """Linear LR scaling with the number of ranks: ``lr * (1 + (world_size - 1) * ratio)``.

    ``ratio=1`` is the classic linear rule, ``ratio=0`` turns scaling off.
    """
    AT_LEAST_ONE("world size", world_size)
    ratio = nonneg("lr scale ratio", ratio, "lr scaling")
    return float(lr) * (1.0 + (world_size - 1) * ratio)
