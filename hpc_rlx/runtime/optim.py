"""Optimizers and learning-rate schedules: pure array math on flat parameter/gradient arrays.

Parameters and gradients arrive as ONE flat array each (views into the fused bucket), so every
update is a handful of whole-array ops. ``xp`` is the array module (NumPy or CuPy) the arrays
live in; nothing here imports CuPy or MPI.

Semantics follow ``torch.optim.SGD`` (dampening 0, L2 weight decay added to the gradient,
optional Nesterov) and ``torch.optim.AdamW`` (decoupled weight decay, bias correction), step for
step. Full-size scratch buffers are allocated once, at construction, so a step allocates nothing
of the parameters' size. On NumPy the fused updates (BLAS scal/axpy, ufuncs with ``out=``) run
block by block (``BLOCK_BYTES`` of each array), so an update's passes stay in the core's cache
and main memory sees each array about once per step, with the same bits as whole-array passes
on one BLAS thread (with several, OpenBLAS splits each axpy among them, and the elements at
its seams may round differently by one unit in the last place, blocked or not).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from hpc_rlx.checks import BOOL, Check, checked, is_integral, is_real
from hpc_rlx.errors import CheckpointError, ConfigError
from hpc_rlx.runtime.blas import axpy, fusable, scal

__all__ = [
    "SGD",
    "AdamW",
    "make_optimizer",
    "clip_grad_norm_",
    "Schedule",
    "make_schedule",
    "scaled_lr",
    "OPTIMIZERS",
    "SCHEDULES",
]


def _to_numpy(a) -> np.ndarray:
    # CuPy arrays expose .get(); NumPy arrays pass through (as a copy, so the state is a snapshot).
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        return a.get()
    return np.array(a, copy=True)


BLOCK_BYTES = 256 * 1024     # per array: an AdamW block's 5 arrays (1.25 MiB) stay in a 2 MiB L2


def _blocks(size: int, itemsize: int) -> list[tuple[int, int]]:
    b = max(1, BLOCK_BYTES // itemsize)      # [lo, hi) ranges of BLOCK_BYTES over size elements
    return [(lo, min(size, lo + b)) for lo in range(0, size, b)]


# the range checks of the optimizers and schedules (`hpc_rlx.checks`), labelled "<where>: <name>"
_IN_UNIT = Check(lambda v: is_real(v) and 0.0 <= float(v) < 1.0, "must be a number in [0, 1)")
_NONNEG = Check(lambda v: is_real(v) and math.isfinite(float(v)) and float(v) >= 0.0,
                "must be a finite number >= 0")
_POSITIVE = Check(lambda v: is_real(v) and math.isfinite(float(v)) and float(v) > 0.0,
                  "must be a finite number > 0")
_COUNT = Check(lambda v: is_integral(v) and v >= 0, "must be an integer >= 0")
_AT_LEAST_ONE = Check(lambda v: is_integral(v) and v >= 1, "must be an integer >= 1")


def _check_in_unit(name: str, v, where: str) -> float:
    """``v`` in [0, 1): the range of momentum and Adam betas."""
    return float(checked(_IN_UNIT, f"{where}: {name}", v))


def _check_nonneg(name: str, v, where: str) -> float:
    return float(checked(_NONNEG, f"{where}: {name}", v))


class _Optimizer:
    """Shared plumbing: flat-size checks, state save/load."""

    name = "?"
    _array_names: tuple[str, ...] = ()

    def __init__(self, size: int, xp, dtype):
        _COUNT(f"{self.name}: parameter count", size)
        self.size = int(size)
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.step_count = 0

    def _zeros(self):
        return self.xp.zeros(self.size, dtype=self.dtype)

    def _check_args(self, params, grads) -> None:
        if params.shape != (self.size,) or grads.shape != (self.size,):
            raise ValueError(
                f"{self.name}.step expects flat arrays of {self.size} elements, got params "
                f"{tuple(params.shape)} and grads {tuple(grads.shape)}"
            )

    def state_dict(self) -> dict[str, dict[str, Any]]:
        arrays = {n: _to_numpy(getattr(self, "_" + n)) for n in self._array_names}
        return {"arrays": arrays, "scalars": {"step": int(self.step_count)}}

    def load_state_dict(self, d) -> None:
        try:
            arrays, scalars = d["arrays"], d["scalars"]
            step = scalars["step"]
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"{self.name} optimizer state must have 'arrays' and 'scalars' with a 'step'; "
                f"missing {e}"
            ) from None
        missing = [n for n in self._array_names if n not in arrays]
        if missing:
            raise CheckpointError(
                f"{self.name} optimizer state lacks arrays {missing} (has {sorted(arrays)}); "
                "was it saved by another optimizer?"
            )
        for n in self._array_names:
            a = np.asarray(arrays[n])
            if a.shape != (self.size,):
                raise CheckpointError(
                    f"{self.name} optimizer state array {n!r} has shape {a.shape}, the model has "
                    f"{self.size} parameters"
                )
        if not (is_integral(step) and step >= 0):
            raise CheckpointError(f"{self.name} optimizer state has a bad step count {step!r}")
        for n in self._array_names:
            getattr(self, "_" + n)[...] = self.xp.asarray(np.asarray(arrays[n], dtype=self.dtype))
        self.step_count = int(step)

    def nbytes(self) -> int:
        """Bytes of the arrays this optimizer holds: its state and its scratch buffers."""
        return sum(int(v.nbytes) for v in vars(self).values() if hasattr(v, "nbytes") and hasattr(v, "shape"))

    def reset(self) -> None:
        """Forget all state: the next step behaves like the first one."""
        for n in self._array_names:
            getattr(self, "_" + n).fill(0)
        self.step_count = 0


class SGD(_Optimizer):
    """SGD with optional momentum (dampening 0), Nesterov and L2 weight decay, as torch.optim.SGD."""

    name = "sgd"

    def __init__(self, size, xp, dtype, momentum=0.0, nesterov=False, weight_decay=0.0):
        super().__init__(size, xp, dtype)
        self.momentum = _check_in_unit("momentum", momentum, "sgd")
        self.weight_decay = _check_nonneg("weight_decay", weight_decay, "sgd")
        BOOL("sgd: nesterov", nesterov)
        if nesterov and self.momentum == 0.0:
            raise ConfigError("sgd: nesterov=true needs momentum > 0, got momentum=0")
        self.nesterov = nesterov
        self._array_names = ("momentum_buffer",) if self.momentum else ()
        if self.momentum:
            self._momentum_buffer = self._zeros()
        self._scratch = self._zeros()
        self._scratch2 = self._zeros() if nesterov else None
        self._ranges = _blocks(self.size, self.dtype.itemsize)

    def step(self, params, grads, lr: float, grad_scale: float = 1.0) -> None:
        """One step with the gradient ``grad_scale * grads`` (the runtime passes the summed
        gradient and 1 / samples: the mean is never written out as its own pass). ``grads``
        may be overwritten."""
        self._check_args(params, grads)
        lr, scale = float(lr), float(grad_scale)
        if not self.nesterov and fusable(params, grads):
            self._fused_step(params, grads, lr, scale)
        else:
            if scale != 1.0:
                grads *= scale
            self._plain_step(params, grads, lr)
        self.step_count += 1

    def _fused_step(self, params, grads, lr: float, scale: float) -> None:
        """torch's update in BLAS passes: buf = m*buf + s*g + wd*p; p -= lr*buf (3-4 passes
        where NumPy needs 5-6 and a scratch array), block by block."""
        first = self.step_count == 0
        for lo, hi in self._ranges:
            self._fused_block(params[lo:hi], grads[lo:hi], lr, scale, first,
                              self._momentum_buffer[lo:hi] if self.momentum else None)

    def _fused_block(self, params, grads, lr: float, scale: float, first: bool, buf) -> None:
        if buf is None:
            if self.weight_decay:
                scal(1.0 - lr * self.weight_decay, params)
            axpy(-lr * scale, grads, params)
            return
        if first:
            # torch starts the buffer at the first gradient, not at zero
            np.multiply(grads, scale, out=buf)
        else:
            scal(self.momentum, buf)
            axpy(scale, grads, buf)
        if self.weight_decay:
            axpy(self.weight_decay, params, buf)
        axpy(-lr, buf, params)

    def _plain_step(self, params, grads, lr: float) -> None:
        xp = self.xp
        d = grads
        if self.weight_decay:
            d = self._scratch
            xp.multiply(params, self.weight_decay, out=d)
            d += grads
        if self.momentum:
            buf = self._momentum_buffer
            if self.step_count == 0:
                # torch starts the buffer at the first gradient, not at zero
                xp.copyto(buf, d)
            else:
                buf *= self.momentum
                buf += d
            if self.nesterov:
                xp.multiply(buf, self.momentum, out=self._scratch2)
                if d is grads:
                    xp.add(grads, self._scratch2, out=self._scratch)
                else:
                    self._scratch += self._scratch2
                d = self._scratch
            else:
                d = buf
        xp.multiply(d, lr, out=self._scratch)
        params -= self._scratch


class AdamW(_Optimizer):
    """Adam with decoupled weight decay and bias correction, as torch.optim.AdamW (no amsgrad)."""

    name = "adamw"
    _array_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, size, xp, dtype, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(size, xp, dtype)
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ConfigError(f"adamw: betas must be a pair of numbers, got {betas!r}") from None
        self.beta1 = _check_in_unit("betas[0]", b1, "adamw")
        self.beta2 = _check_in_unit("betas[1]", b2, "adamw")
        _POSITIVE("adamw: eps", eps)
        self.eps = float(eps)
        self.weight_decay = _check_nonneg("weight_decay", weight_decay, "adamw")
        self._exp_avg = self._zeros()
        self._exp_avg_sq = self._zeros()
        self._scratch = self._zeros()
        self._ranges = _blocks(self.size, self.dtype.itemsize)

    def step(self, params, grads, lr: float, grad_scale: float = 1.0) -> None:
        """One step with the gradient ``grad_scale * grads``; ``grads`` may be overwritten."""
        self._check_args(params, grads)
        lr, scale = float(lr), float(grad_scale)
        self.step_count += 1
        if fusable(params, grads):
            self._fused_step(params, grads, lr, scale)
        else:
            if scale != 1.0:
                grads *= scale
            self._plain_step(params, grads, lr)

    def _fused_step(self, params, grads, lr: float, scale: float) -> None:
        """torch's update in 10 in-place passes per block (BLAS scal/axpy, NumPy ufuncs with
        ``out=``) where the plain form takes 15 over whole arrays, the gradient scale folded
        into the coefficients:
            m = b1*m + (1-b1)*s*g;   v = b2*v + (1-b2)*s^2*g^2
            p -= (step_size*c2) * m / (sqrt(v) + eps*c2)     (c2 = sqrt of bias correction 2)
        the same value as torch's m / (sqrt(v)/c2 + eps) * step_size, rounded differently
        (a few ulp: tests/unit/runtime/test_lean_step.py)."""
        k = self.step_count
        c2 = math.sqrt(1.0 - self.beta2**k)
        decay = 1.0 - lr * self.weight_decay
        b1, b2, gm, gv = self.beta1, self.beta2, (1.0 - self.beta1) * scale, (1.0 - self.beta2) * scale * scale
        eps, a = self.eps * c2, -lr / (1.0 - self.beta1**k) * c2
        m_all, v_all, t_all = self._exp_avg, self._exp_avg_sq, self._scratch
        for lo, hi in self._ranges:
            p, g, m, v, t = params[lo:hi], grads[lo:hi], m_all[lo:hi], v_all[lo:hi], t_all[lo:hi]
            if self.weight_decay:
                scal(decay, p)
            scal(b1, m)
            axpy(gm, g, m)
            np.multiply(g, g, out=t)
            scal(b2, v)
            axpy(gv, t, v)
            np.sqrt(v, out=t)
            t += eps
            np.divide(m, t, out=t)
            axpy(a, t, p)

    def _plain_step(self, params, grads, lr: float) -> None:
        """torch's update op for op (any array module: CuPy arrays, strided views)."""
        xp = self.xp
        m, v, t = self._exp_avg, self._exp_avg_sq, self._scratch
        k = self.step_count
        if self.weight_decay:
            params *= 1.0 - lr * self.weight_decay
        # m <- lerp(m, g, 1 - beta1), in the same two-branch form torch uses, for equal rounding
        w = 1.0 - self.beta1
        xp.subtract(grads, m, out=t)
        if w < 0.5:
            t *= w
            m += t
        else:
            t *= 1.0 - w
            xp.subtract(grads, t, out=m)
        v *= self.beta2
        xp.multiply(grads, 1.0 - self.beta2, out=t)
        t *= grads
        v += t
        step_size = lr / (1.0 - self.beta1**k)
        bc2_sqrt = math.sqrt(1.0 - self.beta2**k)
        xp.sqrt(v, out=t)
        t /= bc2_sqrt
        t += self.eps
        xp.divide(m, t, out=t)
        t *= step_size
        params -= t


OPTIMIZERS = {"sgd": SGD, "adamw": AdamW}
OPTIMIZER_KEYS = {
    "sgd": ("momentum", "nesterov", "weight_decay"),
    "adamw": ("betas", "eps", "weight_decay"),
}


def make_optimizer(name: str, size: int, xp, dtype, **kwargs):
    """Build ``name`` ("sgd" or "adamw") over ``size`` flat parameters; unknown names/keys raise."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    unknown = sorted(set(kwargs) - set(OPTIMIZER_KEYS[name]))
    if unknown:
        raise ConfigError(
            f"optimizer {name!r} does not take {unknown}; it takes {list(OPTIMIZER_KEYS[name])}"
        )
    return OPTIMIZERS[name](size, xp, dtype, **kwargs)


def clip_grad_norm_(grads_flat, max_norm: float) -> float:
    """Scale ``grads_flat`` in place so its L2 norm is at most ``max_norm``; return the norm before.

    Like torch.nn.utils.clip_grad_norm_ (coefficient ``max_norm / (norm + 1e-6)``), except that a
    non-finite norm leaves the gradients untouched: the caller sees it and can skip the step.
    """
    Check(lambda v: is_real(v) and float(v) > 0.0, "must be a number > 0")("gradient clipping max_norm",
                                                                          max_norm)
    # dot of a 1-D array with itself: no full-size temporary, one reduction on either backend
    norm = math.sqrt(float(grads_flat.dot(grads_flat))) if grads_flat.size else 0.0
    if math.isfinite(norm) and norm > max_norm:
        grads_flat *= float(max_norm) / (norm + 1e-6)
    return norm


SCHEDULES = ("constant", "step", "cosine")


class Schedule:
    """``lr = schedule(step)`` for a 0-based optimizer step; see :func:`make_schedule`."""

    def __init__(self, name, base_lr, total_steps, warmup_steps, step_size, gamma, min_lr):
        self.name = name
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
        span = self.total_steps - w
        if s >= span:
            return self.min_lr
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * s / span))

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, base_lr={self.base_lr}, total_steps={self.total_steps}, "
            f"warmup_steps={self.warmup_steps}, step_size={self.step_size}, gamma={self.gamma}, "
            f"min_lr={self.min_lr})"
        )


def make_schedule(
    name: str,
    base_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    step_size: int | None = None,
    gamma: float = 0.1,
    min_lr: float = 0.0,
) -> Callable[[int], float]:
    """An LR schedule over 0-based steps, with an optional linear warmup in front.

    - warmup (any schedule): ``base_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``;
    - "constant": ``base_lr``;
    - "step": ``base_lr * gamma ** ((step - warmup) // step_size)``, floored at ``min_lr``;
    - "cosine": from ``base_lr`` down to ``min_lr`` over the ``total_steps - warmup_steps`` steps
      after warmup, then held at ``min_lr`` (it does not rise again like torch's periodic form).
    """
    where = f"lr schedule {name!r}"
    if name not in SCHEDULES:
        raise ConfigError(f"unknown lr schedule {name!r}; choose one of {list(SCHEDULES)}")
    base_lr = _check_nonneg("base_lr", base_lr, where)
    min_lr = _check_nonneg("min_lr", min_lr, where)
    for label, v in (("total_steps", total_steps), ("warmup_steps", warmup_steps)):
        _COUNT(f"{where}: {label}", v)
    total_steps, warmup_steps = int(total_steps), int(warmup_steps)
    if total_steps < 1:
        raise ConfigError(f"{where}: total_steps must be >= 1, got {total_steps}")
    if warmup_steps > total_steps:
        raise ConfigError(
            f"{where}: warmup_steps ({warmup_steps}) is more than total_steps ({total_steps})"
        )
    if name == "cosine" and warmup_steps >= total_steps:
        raise ConfigError(
            f"{where}: warmup_steps ({warmup_steps}) leaves no steps to anneal over "
            f"(total_steps={total_steps})"
        )
    if name != "constant" and min_lr > base_lr:
        raise ConfigError(f"{where}: min_lr ({min_lr}) is above base_lr ({base_lr})")
    if name == "step":
        _AT_LEAST_ONE(f"{where}: step_size", step_size)
        step_size = int(step_size)
        Check(lambda v: is_real(v) and 0.0 < float(v) <= 1.0, "must be a number in (0, 1]")(f"{where}: gamma",
                                                                                         gamma)
    return Schedule(name, base_lr, total_steps, warmup_steps, step_size, float(gamma), min_lr)


def scaled_lr(lr: float, world_size: int, ratio: float) -> float:
    """Linear LR scaling with the number of ranks: ``lr * (1 + (world_size - 1) * ratio)``.

    ``ratio=1`` is the classic linear rule, ``ratio=0`` turns scaling off.
    """
    _AT_LEAST_ONE("world size", world_size)
    ratio = _check_nonneg("lr scale ratio", ratio, "lr scaling")
    return float(lr) * (1.0 + (world_size - 1) * ratio)
