"""What every optimizer shares: its declaration (name, default learning rate, hyper-parameters,
state arrays) and the plumbing (flat-size checks, state save and load, memory held).

An optimizer is one module of this package and one line of `registry.py`. It declares:

- ``name``: what `optim=NAME` selects;
- ``lr``: the config's default base learning rate for it;
- ``hyper``: its own keys, each a `Hyper` (default, one-line doc, check). The config schema
  (`optim.*` keys and their defaults per option), the spec's checks and the arguments the
  runtime passes all derive from them;
- ``_array_names``: the state arrays a checkpoint saves (parameter-sized, `_<name>` attributes).

Parameters and gradients arrive as ONE flat array each (views into the fused bucket), so every
update is a handful of whole-array ops. Where the parameters begin and end in it are its
``segments`` (`segments.py`; without them the array is one parameter); an update that needs
per-parameter norms (LAMB's and LARS's trust ratios) takes them from `segment_norms`. ``xp``
is the array module (NumPy or CuPy) the arrays live in; nothing here imports CuPy or MPI.
Full-size scratch buffers are allocated once, at construction, so a step allocates nothing of
the parameters' size.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hpc_rlx.base.checks import Check, is_integral, is_real
from hpc_rlx.base import backend
from hpc_rlx.base.errors import CheckpointError, ConfigError, check_param
from hpc_rlx.optim.groups import DEFAULT, ParamSetting, runs
from hpc_rlx.optim.segments import check_segments, whole_array

BLOCK_BYTES = 256 * 1024     # per array: an AdamW block's 5 arrays (1.25 MiB) stay in a 2 MiB L2

# the range checks of the optimizers and schedules (`hpc_rlx.base.checks`): a failed one names the
# parameter (`errors.check_param`: "<where>: <name> must ...", the name kept apart from the text)
IN_UNIT = Check(lambda v: is_real(v) and 0.0 <= float(v) < 1.0, "must be a number in [0, 1)")
NONNEG = Check(lambda v: is_real(v) and math.isfinite(float(v)) and float(v) >= 0.0,
               "must be a finite number >= 0")
POSITIVE = Check(lambda v: is_real(v) and math.isfinite(float(v)) and float(v) > 0.0,
                 "must be a finite number > 0")
COUNT = Check(lambda v: is_integral(v) and v >= 0, "must be an integer >= 0")
AT_LEAST_ONE = Check(lambda v: is_integral(v) and v >= 1, "must be an integer >= 1")
_NUMBER = (int, float)


@dataclass(frozen=True)
class Hyper:
    """One key an optimizer takes from the `optim` section: `optim.<name>`."""
    name: str
    default: Any                    # the config default (config.yaml's optim/<optimizer>.yaml)
    doc: str                        # one line, for docs/config.md
    check: Check | None = None      # the range check: the schema's (`optim.<name>`) and the class's
    type: Any = _NUMBER             # what the schema accepts
    to_arg: Callable[[Any], Any] = lambda v: v     # config value -> constructor argument


def in_unit(name: str, v, where: str, qualifier: str = "") -> float:
    """``v`` in [0, 1): the range of momentum and moment decay rates (``qualifier``: which
    element of parameter ``name``, as ``[0]``)."""
    return float(check_param(IN_UNIT, name, v, where, qualifier))


def decay_pair(betas, where: str) -> tuple[float, float]:
    """``betas``: two decay rates, each in [0, 1)."""
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ConfigError.bad_param("betas", f" must be a pair of numbers, got {betas!r}", where) from None
    return in_unit("betas", b1, where, "[0]"), in_unit("betas", b2, where, "[1]")


def nonneg(name: str, v, where: str) -> float:
    return float(check_param(NONNEG, name, v, where))


def blocks(size: int, itemsize: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of BLOCK_BYTES over ``size`` elements: a fused update's passes per block
    stay in the core's cache, and main memory sees each array about once per step."""
    b = max(1, BLOCK_BYTES // itemsize)
    return [(lo, min(size, lo + b)) for lo in range(0, size, b)]


def _to_numpy(a) -> np.ndarray:
    # A device array is copied to the host; a host one is copied too, so the state is a snapshot.
    if backend.is_device_array(a):
        return backend.to_numpy(a)
    return np.array(a, copy=True)


class Optimizer:
    """Shared plumbing: flat-size checks, state save/load, the memory held."""

    name = "?"
    lr: float = 0.0                     # the config's default base learning rate
    hyper: tuple[Hyper, ...] = ()       # the optimizer's own `optim.*` keys
    _array_names: tuple[str, ...] = ()  # the state a checkpoint holds
    # True: `_step` applies the per-segment settings itself (LAMB, LARS: their trust ratios'
    # norms are one collective a step, so the array cannot be stepped run by run)
    steps_settings_itself = False

    def __init__(self, size: int, xp, dtype):
        COUNT(f"{self.name}: parameter count", size)
        self.size = int(size)
        self.xp = xp
        self.dtype = np.dtype(dtype)
        self.step_count = 0
        self.segments = whole_array(self.size)
        self.combine_norms = None
        self.settings: tuple[ParamSetting, ...] | None = None    # per segment; None: all DEFAULT
        self._ranges = blocks(self.size, self.dtype.itemsize)
        self._runs: list | None = None

    def use_segments(self, segments, combine_norms=None) -> None:
        """The parameters' segments of this optimizer's array (`segments.Segment`s tiling it)
        and, where some are parts of parameters other ranks' slices hold the rest of, what
        completes their squared norms: ``combine_norms(partial) -> total`` on the host array
        (segments, k); a collective, called once per `segment_norms` on every rank."""
        self.segments = check_segments(segments, self.size)
        self.combine_norms = combine_norms

    def use_settings(self, by_param) -> None:
        """Per-parameter settings (`groups.ParamSetting`, indexed by the segments' parameter
        ``index``: optim.no_decay, optim.lr_mult); all default: the plain step, unchanged."""
        settings = tuple(by_param[seg.index] for seg in self.segments)
        if all(s == DEFAULT for s in settings):
            self.settings, self._runs = None, None
            return
        self.settings = settings
        if not self.steps_settings_itself:
            self._runs = [(lo, hi, s.lr_mult, self._view(lo, hi, s)) for lo, hi, s in runs(self.segments, by_param)]

    def _view(self, lo: int, hi: int, setting: ParamSetting) -> "Optimizer":
        """This optimizer over [lo, hi) of its array: the same hyper-parameters and state (views
        of its arrays), without weight decay where `setting` says so."""
        size = hi - lo
        state = {name: value[lo:hi] for name, value in vars(self).items()
                 if getattr(value, "shape", None) == (self.size,)}
        state.update(size=size, _ranges=blocks(size, self.dtype.itemsize), segments=whole_array(size),
                     settings=None, _runs=None)
        if not setting.decay:
            state["weight_decay"] = 0.0
        view = copy.copy(self)
        vars(view).update(state)     # this optimizer sets the view's state: its own class's
        return view

    def step(self, params, grads, lr: float, grad_scale: float = 1.0) -> None:
        """One step with the gradient ``grad_scale * grads`` (the runtime passes the summed
        gradient and 1 / samples); ``grads`` may be overwritten. With per-parameter settings,
        each run of one setting is stepped as its own parameter group (its learning rate times
        its factor), the step count shared."""
        self._check_args(params, grads)
        lr, grad_scale = float(lr), float(grad_scale)
        if self._runs is None:
            self._step(params, grads, lr, grad_scale)
            return
        count = self.step_count
        for lo, hi, factor, view in self._runs:
            view.step_count = count
            view.step(params[lo:hi], grads[lo:hi], lr * factor, grad_scale)   # a view steps whole
        self.step_count = count + 1

    def setting_of(self, k: int) -> ParamSetting:
        """Segment k's setting."""
        return DEFAULT if self.settings is None else self.settings[k]

    def segment_norms(self, *arrays) -> np.ndarray:
        """Per segment, the L2 norm of each of ``arrays`` over the segment's whole parameter:
        float64 on the host, shape (segments, len(arrays))."""
        parts = [a[s.start:s.stop].dot(a[s.start:s.stop]) for s in self.segments for a in arrays]
        squared = (_to_numpy(self.xp.stack(parts)).astype(np.float64) if parts
                   else np.zeros(0)).reshape(len(self.segments), len(arrays))
        if self.combine_norms is not None:
            squared = self.combine_norms(squared)
        return np.sqrt(squared)

    def _zeros(self):
        return self.xp.zeros(self.size, dtype=self.dtype)

    def _check_args(self, params, grads) -> None:
        if params.shape != (self.size,) or grads.shape != (self.size,):
            raise ValueError(
                f"{self.name}.step expects flat arrays of {self.size} elements, got params "
                f"{tuple(params.shape)} and grads {tuple(grads.shape)}"
            )

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """The update over the whole array (checked by `step`)."""
        raise NotImplementedError

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
