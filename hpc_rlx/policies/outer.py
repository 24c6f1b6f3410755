"""Outer optimizers: turn the consensus W into the next global model, at every sync.

`policy.outer`:

- `average`: the consensus itself.
- `diloco`: Nesterov momentum on the pseudo-gradient `g = W_prev - W`
  (`v = mu*v + g; W_new = W_prev - lr*(g + mu*v)`), defaults lr 0.7, mu 0.9 (the DiLoCo
  paper, Douillard et al., 2023), after a warm-up of 18 syncs of plain averaging. The paper
  starts its workers from a pretrained model; from a random one, the momentum amplifies the
  large early pseudo-gradients, and the run never recovers (`experiment=lm`, 2 ranks, K=25,
  seed 3: val loss 1.477 without the warm-up, 1.381 after 9 syncs, 1.351 after 18, sync 1.379;
  4 ranks 1.447 / 1.431, sync 1.379; `bench/README.md`).
- `slowmo`: slow momentum on the same pseudo-gradient, in the paper's inner-LR units:
  `u = beta*u + g/gamma; W_new = W_prev - alpha*gamma*u` with `gamma` the inner LR at the
  sync (1 when not given), defaults alpha 1.0, beta 0.5, no warm-up.

`warmup` (`policy.outer_warmup`): the first syncs take the consensus as it is and start no
momentum; the count of syncs seen is part of the state (a resumed run does not warm up again).

Every rank keeps its own inner optimizer state (AdamW moments, momentum) across syncs, as the
DiLoCo paper's workers do; `reset_inner=True` (`policy.reset_inner`) sets `resets_inner`,
which tells the loop to reset it after every sync (measured worse: see `bench/README.md`).

`W_prev` is the previous global model, identical on every rank. The state (previous global,
momentum) is replicated: every rank applies the same deterministic update to the same
consensus, so it needs no collective. Every update is in place, with no temporaries.
Arrays may be NumPy or CuPy (only array methods and ufuncs with `out=` are used).
"""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.base.errors import ConfigError


class OuterOptimizer:
    """Interface the loop calls: `begin(params)` once, then `step(params)` after each sync."""

    name = "base"
    resets_inner = False

    def begin(self, params) -> None:
        """Record the starting global model (the broadcast initial params)."""

    def step(self, params, inner_lr: float | None = None, part: slice = slice(None),
             fragment: int = 0) -> None:
        """`params` holds the consensus; overwrite it in place with the new global model.
        With streaming syncs (`fragments.py`), `params` is one fragment's consensus, `part` its
        place in the parameters and `fragment` its index (each fragment counts its own syncs)."""

    def state_dict(self) -> dict:
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        _check_name(self.name, state)


class OuterAverage(OuterOptimizer):
    """Plain consensus: the new global model is the work-weighted average."""

    name = "average"


class _MomentumOuter(OuterOptimizer):
    def __init__(self, lr: float, momentum: float, warmup: int = 0):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ConfigError(f"policy.outer_warmup must be an integer >= 0, got {warmup!r}")
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ConfigError(f"policy.outer_lr must be a finite number > 0, got {lr!r}")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ConfigError(f"policy.outer_momentum must be in [0, 1), got {momentum!r}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.warmup = warmup
        self.done = [0]         # syncs seen per fragment: the first `warmup` take the consensus
        self.prev = None
        self.buf = None

    def begin(self, params) -> None:
        self.prev = params.copy()
        self.buf = params.copy()
        self.buf.fill(0)

    def step(self, params, inner_lr: float | None = None, part: slice = slice(None),
             fragment: int = 0) -> None:
        if self.prev is None:
            raise RuntimeError(f"outer optimizer '{self.name}': call begin(params) before step()")
        prev, buf = self.prev[part], self.buf[part]     # views: the updates land in the state
        if params.shape != prev.shape:
            raise ValueError(f"params shape {tuple(params.shape)} != outer state "
                             f"{tuple(prev.shape)}")
        while len(self.done) <= fragment:
            self.done.append(0)
        self.done[fragment] += 1
        if self.done[fragment] <= self.warmup:
            prev[...] = params                  # the consensus is the new global model
            return
        self._outer_step(params, prev, buf, inner_lr)

    def _outer_step(self, params, prev, buf, inner_lr: float | None) -> None:
        raise NotImplementedError

    @staticmethod
    def _pseudo_grad_into(params, prev) -> None:
        np.subtract(prev, params, out=params)   # params now holds g = W_prev - W

    @staticmethod
    def _descend(params, prev, buf, scale: float) -> None:
        # W_prev -= scale * buf, using params (free by now) as scratch; the result is both the
        # new global model and the next W_prev
        np.multiply(buf, scale, out=params)
        prev -= params
        params[...] = prev

    def state_dict(self) -> dict:
        done = self.done[0] if len(self.done) == 1 else list(self.done)
        return {"name": self.name, "lr": self.lr, "momentum": self.momentum, "done": done,
                "prev": _host_copy(self.prev), "buf": _host_copy(self.buf)}

    def load_state_dict(self, state: dict) -> None:
        _check_name(self.name, state)
        if self.prev is None:
            raise RuntimeError(f"outer optimizer '{self.name}': call begin(params) before "
                               "load_state_dict() so the state lands on the right device")
        done = state.get("done", 0)
        self.done = [int(d) for d in done] if isinstance(done, (list, tuple)) else [int(done)]
        for key in ("prev", "buf"):
            src = np.asarray(state[key])
            dst = getattr(self, key)
            if src.shape != dst.shape:
                raise ValueError(f"outer state '{key}' has shape {src.shape}, model has {dst.shape}")
            _copy_into(dst, src)


class DiLoCo(_MomentumOuter):
    name = "diloco"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True,
                 warmup: int = 18):
        super().__init__(lr, momentum, warmup)
        self.nesterov = bool(nesterov)

    def _outer_step(self, params, prev, buf, inner_lr: float | None) -> None:
        self._pseudo_grad_into(params, prev)    # params = g
        buf *= self.momentum
        buf += params                           # v = mu*v + g
        if self.nesterov:
            params *= self.lr
            prev -= params                      # W_prev - lr*g ...
            self._descend(params, prev, buf, self.lr * self.momentum)  # ... - lr*mu*v
        else:
            self._descend(params, prev, buf, self.lr)      # W_prev - lr*v


class SlowMo(_MomentumOuter):
    name = "slowmo"

    def __init__(self, lr: float = 1.0, momentum: float = 0.5, warmup: int = 0):
        super().__init__(lr, momentum, warmup)

    def _outer_step(self, params, prev, buf, inner_lr: float | None) -> None:
        gamma = 1.0 if inner_lr is None else float(inner_lr)
        if not (math.isfinite(gamma) and gamma > 0):
            raise ValueError(f"inner_lr must be finite and > 0, got {inner_lr!r}")
        self._pseudo_grad_into(params, prev)
        params /= gamma
        buf *= self.momentum
        buf += params                           # u = beta*u + g/gamma
        self._descend(params, prev, buf, self.lr * gamma)  # W_prev - alpha*gamma*u


OUTERS = {"average": OuterAverage, "diloco": DiLoCo, "slowmo": SlowMo}


def make_outer(name: str, lr: float | None = None, momentum: float | None = None,
               reset_inner: bool = False, warmup: int | None = None, **extra) -> OuterOptimizer:
    """Build `policy.outer` by name; lr / momentum / warmup of None take the method's defaults;
    `reset_inner`: the loop resets the inner optimizer's state after every sync; `warmup`:
    the first syncs that take the consensus as it is, before the outer momentum starts."""
    if name not in OUTERS:
        raise ConfigError(f"policy.outer must be one of {sorted(OUTERS)}, got {name!r}")
    if not isinstance(reset_inner, bool):
        raise ConfigError(f"policy.reset_inner must be true or false, got {reset_inner!r}")
    if name == "average":
        given = {k: v for k, v in dict(extra, lr=lr, momentum=momentum).items() if v is not None}
        if warmup:
            given["outer_warmup"] = warmup
        if given:
            raise ConfigError(f"policy.outer=average takes no parameters, got {given}")
        outer = OuterAverage()
    else:
        kwargs = dict(extra)
        if warmup is not None:
            kwargs["warmup"] = warmup
        if lr is not None:
            kwargs["lr"] = lr
        if momentum is not None:
            kwargs["momentum"] = momentum
        try:
            outer = OUTERS[name](**kwargs)
        except TypeError as e:
            raise ConfigError(f"bad parameters for policy.outer={name}: {kwargs} ({e})") from None
    outer.resets_inner = reset_inner
    return outer


def outer_from_config(cfg) -> OuterOptimizer:
    """The outer optimizer of a `policy.*` config (keys `outer`, `outer_lr`, `outer_momentum`,
    `outer_warmup`, `reset_inner`)."""
    return make_outer(cfg["outer"], cfg["outer_lr"], cfg["outer_momentum"],
                      reset_inner=cfg["reset_inner"], warmup=cfg["outer_warmup"])


def _check_name(name: str, state: dict) -> None:
    if state.get("name") != name:
        raise ValueError(f"outer optimizer state is for {state.get('name')!r}, not {name!r}")


def _host_copy(a):
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return a.copy()
    return a.get()


def _copy_into(dst, src: np.ndarray) -> None:
    if isinstance(dst, np.ndarray):
        dst[...] = src
    else:
        dst.set(src.astype(dst.dtype, copy=False))
