"""Parameter storage and initialisation.

Parameters (and their gradients) live in one caller-owned flat array each; ``ParamLayout``
hands out per-parameter views in declaration order, so the runtime can all-reduce the
gradient buffer as it is. Init schemes are plain data in the graph (``{"scheme": ...}``) and
are drawn per parameter from ``SeedSequence([seed, index])``: the same seed gives the same
values whatever the buffer's dtype or the other parameters.
"""

from __future__ import annotations

import copy
import math
from math import prod

import numpy as np

# scheme -> {allowed key: default (None = required)}
INIT_SCHEMES = {
    "zeros": {},
    "ones": {},
    "constant": {"value": None},
    "normal": {"std": None, "mean": 0.0},
    "uniform": {"bound": None},
    "he_normal": {"fan_in": 0},
    "he_uniform": {"fan_in": 0},
    "fan_in_uniform": {"fan_in": 0},
    "xavier_normal": {"fan_in": 0, "fan_out": 0, "gain": 1.0},
    "xavier_uniform": {"fan_in": 0, "fan_out": 0, "gain": 1.0},
}


def default_fans(shape) -> tuple:
    """(fan_in, fan_out) when the graph does not state them: (in, out) matrices, (O, C, kh, kw) and
    (O, C, kd, kh, kw) kernels."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) in (4, 5):
        rf = prod(shape[2:])
        return shape[1] * rf, shape[0] * rf
    return prod(shape[:-1]), shape[-1]


def check_init(init, shape) -> None:
    """Raise ValueError describing what is wrong with an init spec."""
    if not isinstance(init, dict) or not isinstance(init.get("scheme"), str):
        raise ValueError(f"init must be an object with a 'scheme' string, got {init!r}")
    scheme = init["scheme"]
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"unknown init scheme {scheme!r} (known: {', '.join(INIT_SCHEMES)})")
    allowed = INIT_SCHEMES[scheme]
    extra = sorted(set(init) - set(allowed) - {"scheme"})
    if extra:
        raise ValueError(f"init scheme {scheme!r} takes {sorted(allowed) or 'no options'}, not {extra}")
    for key, default in allowed.items():
        if default is None and key not in init:
            raise ValueError(f"init scheme {scheme!r} needs {key!r}")
        if key in init:
            v = init[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"init option {key!r} must be a finite number, got {v!r}")
            if key in ("std", "bound") and v < 0 or key.startswith("fan") and v < 0:
                raise ValueError(f"init option {key!r} must be >= 0, got {v!r}")


def draw_init(init: dict, shape, rng: np.random.Generator) -> np.ndarray:
    """Float64 values for one parameter."""
    scheme = init["scheme"]
    d_in, d_out = default_fans(shape)
    fan_in = init.get("fan_in") or d_in
    fan_out = init.get("fan_out") or d_out
    if scheme == "zeros":
        return np.zeros(shape)
    if scheme == "ones":
        return np.ones(shape)
    if scheme == "constant":
        return np.full(shape, float(init["value"]))
    if scheme == "normal":
        return rng.normal(init.get("mean", 0.0), init["std"], size=shape)
    if scheme == "uniform":
        return rng.uniform(-init["bound"], init["bound"], size=shape)
    if scheme == "he_normal":
        return rng.normal(0.0, math.sqrt(2.0 / fan_in), size=shape)
    if scheme == "he_uniform":
        b = math.sqrt(6.0 / fan_in)
        return rng.uniform(-b, b, size=shape)
    if scheme == "fan_in_uniform":
        b = 1.0 / math.sqrt(fan_in)
        return rng.uniform(-b, b, size=shape)
    gain = init.get("gain", 1.0)
    if scheme == "xavier_normal":
        return rng.normal(0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)), size=shape)
    if scheme == "xavier_uniform":
        b = gain * math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-b, b, size=shape)
    raise ValueError(f"unknown init scheme {scheme!r}")


def param_flags(obj: dict) -> tuple[bool, bool]:
    """(trainable, frozen) of a parameter's JSON form; ValueError if they are not booleans or a
    buffer is marked frozen. Three kinds: a trainable parameter; a frozen one (`model.freeze`,
    `model.train_only`: used as it is, never differentiated or stepped); a buffer
    (``trainable: false``, batch-norm running statistics, which an op updates)."""
    trainable, frozen = obj.get("trainable", True), obj.get("frozen", False)
    for key, flag in (("trainable", trainable), ("frozen", frozen)):
        if not isinstance(flag, bool):
            raise ValueError(f"{key} must be true or false, got {flag!r}")
    if frozen and not trainable:
        raise ValueError("a buffer (trainable: false) cannot be frozen: an op updates it")
    return trainable, frozen


def param_dict(p) -> dict:
    """A ParamSpec's JSON form. "trainable" only when false and "frozen" only when true: graphs
    without buffers or frozen parameters keep their JSON (and fingerprint)."""
    return {"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "init": copy.deepcopy(p.init),
            **({} if p.trainable else {"trainable": False}), **({"frozen": True} if p.frozen else {})}


class ParamLayout:
    """Where each parameter lives in a flat buffer: the trainable parameters in declaration
    order, densely packed, then the buffers (non-trainable: batch-norm running statistics),
    then the frozen parameters.

    The optimizer steps ``flat[:trainable_size]``; the buffers ride in the same flat vector so
    that broadcasting, averaging, checkpointing and the fused bucket carry them unchanged. The
    gradient vector (the bucket's payload) is ``flat[:grad_size]``: trainable parameters and
    buffers; the frozen parameters have no place in it, so they are in the parameter vector
    (broadcast, checkpoints, ``model.h5``) but never summed, averaged or stepped."""

    def __init__(self, graph):
        ordered = ([p for p in graph.params if p.trainable and not p.frozen]
                   + [p for p in graph.params if not p.trainable] + [p for p in graph.params if p.frozen])
        self.names = [p.name for p in ordered]
        self.buffer_names = [p.name for p in ordered if not p.trainable]
        self.frozen_names = [p.name for p in ordered if p.frozen]
        self.shapes = {p.name: tuple(p.shape) for p in ordered}
        self.offsets = {}
        off = 0
        for p in ordered:
            self.offsets[p.name] = off
            off += prod(p.shape)
        self.size = off
        self.grad_size = off - sum(prod(p.shape) for p in ordered if p.frozen)
        self.trainable_size = self.grad_size - sum(prod(p.shape) for p in ordered if not p.trainable)

    @property
    def trainable_names(self) -> list:
        """The parameters the optimizer steps, in flat order."""
        return self.names[:len(self.names) - len(self.buffer_names) - len(self.frozen_names)]

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.names)} params, {self.size} elements)"

    def views(self, flat, size: int | None = None) -> dict:
        """name -> view into ``flat`` (NumPy or CuPy, 1-D, contiguous, at least ``size`` long)."""
        size = self.size if size is None else size
        if getattr(flat, "ndim", None) != 1 or not flat.flags.c_contiguous:
            raise ValueError(f"parameter buffer must be a contiguous 1-D array, got shape {getattr(flat, 'shape', None)}")
        if flat.shape[0] < size:
            raise ValueError(f"parameter buffer holds {flat.shape[0]} elements, the layout needs {size}")
        out = {}
        for name in self.names:
            off, shape = self.offsets[name], self.shapes[name]
            if off < size:
                out[name] = flat[off : off + prod(shape)].reshape(shape)
        return out

    def grad_views(self, flat) -> dict:
        """name -> view into the gradient vector ``flat`` (at least ``grad_size`` long): every
        parameter and buffer but the frozen ones."""
        return self.views(flat, self.grad_size)

    def pack(self, arrays: dict, out):
        """Copy per-parameter arrays into the flat buffer ``out`` (e.g. when loading a checkpoint)."""
        views = self.views(out)
        missing = [n for n in self.names if n not in arrays]
        if missing:
            raise ValueError(f"missing parameter(s) {missing}")
        for name, v in views.items():
            if tuple(arrays[name].shape) != v.shape:
                raise ValueError(f"parameter '{name}' has shape {tuple(arrays[name].shape)}, layout says {v.shape}")
            v[...] = arrays[name]
        return out


def init_params(graph, flat: np.ndarray, seed: int) -> np.ndarray:
    """Fill the host buffer ``flat`` with the graph's initial parameter values."""
    if not isinstance(flat, np.ndarray):
        raise TypeError("init_params fills a NumPy buffer; copy it to the device afterwards")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    views = ParamLayout(graph).views(flat)
    streams = graph.param_seeds or range(len(graph.params))  # a pipeline stage draws as the whole graph
    for i, p in zip(streams, graph.params):
        rng = np.random.default_rng([int(seed), i])
        views[p.name][...] = draw_init(p.init, tuple(p.shape), rng)
    return flat
