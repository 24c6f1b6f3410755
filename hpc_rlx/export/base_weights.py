"""What a state dict of an imported model takes from the PyTorch module's original weights
(`export --base F.safetensors`): dynamo's optimizer folds a part of a parameter into a new
initializer (a position table read as ``pos[:, :t]``, or rows gathered at fixed positions), and
the file keeps neither the rest of the parameter nor where the part lies. The part's initial
values, found in the original parameter, say where; the trained part goes back there and the
rest keeps its original values. Parameters the optimizer dropped (never trained) come back
with their original values too."""

from __future__ import annotations

import numpy as np

from hpc_rlx.export.trained import ExportError


def _aligned(part: np.ndarray, ndim: int) -> np.ndarray | None:
    """``part`` with as many dims as the parameter: leading size-1 dims dropped or added."""
    while part.ndim > ndim and part.shape[0] == 1:
        part = part.reshape(part.shape[1:])
    while part.ndim < ndim:
        part = part.reshape((1,) + part.shape)
    return part if part.ndim == ndim else None


def locate(part: np.ndarray, full: np.ndarray) -> tuple | None:
    """The index (a slice per axis) where ``full`` holds ``part`` exactly, None where it holds
    it nowhere; ExportError where it holds it in several places."""
    if part.size == full.size and part.shape != full.shape:
        # the whole parameter in another shape (a norm's weight written as (C, 1) for its broadcast)
        return tuple(slice(0, n) for n in full.shape) if np.array_equal(part.reshape(full.shape), full) else None
    part = _aligned(part, full.ndim)
    if part is None or any(p > f for p, f in zip(part.shape, full.shape)):
        return None
    windows = np.lib.stride_tricks.sliding_window_view(full, part.shape)
    first = windows[(Ellipsis,) + (0,) * part.ndim]
    found = [tuple(int(i) for i in at) for at in np.argwhere(first == part.flat[0])
             if np.array_equal(windows[tuple(at)], part)]
    if len(found) > 1:
        raise ExportError(f"the part appears {len(found)} times in the original parameter (starts {found[:3]}), "
                          f"so where it trained is ambiguous")
    return tuple(slice(a, a + n) for a, n in zip(found[0], part.shape)) if found else None


def _gathered(part: np.ndarray, full: np.ndarray) -> bool:
    """Whether every row of ``part`` (over the last axis) is a row of ``full``: rows gathered
    out of order or repeated (Swin's relative position bias), which have no one place to go."""
    if part.size == 0 or full.ndim == 0 or part.shape[-1:] != full.shape[-1:]:
        return False
    rows = {r.tobytes() for r in full.reshape(-1, full.shape[-1])}
    return all(r.tobytes() in rows for r in part.reshape(-1, part.shape[-1]))


def place_parts(out: dict, meta: dict, initial: dict, base: dict) -> list[str]:
    """Write each trained part back into its full parameter (in ``out``, in place), and the
    parameters the optimizer dropped, from ``base`` (PyTorch name -> original float32 value).
    ``initial``: IR parameter -> the part's value in the source file. Returns a note for each
    part that stays under its file's name (gathered rows)."""
    notes = []
    for ir, full_name in (meta.get("slices") or {}).items():
        name = meta["params"][ir]
        if full_name not in base:
            raise ExportError(f"--base has no {full_name!r}, the parameter {name!r} is a part of")
        full = base[full_name]
        try:
            where = locate(initial[ir], full)
        except ExportError as e:
            raise ExportError(f"{name!r} in --base's {full_name!r}: {e}") from None
        if where is None and _gathered(initial[ir], full):
            notes.append(f"{name!r} holds rows of {full_name!r} gathered out of order or repeated, whose trained "
                         f"copies have no one place in it: it stays under {name!r}")
            continue
        if where is None:
            raise ExportError(f"the initial values of {name!r} are no part of --base's {full_name!r} (shape "
                              f"{tuple(full.shape)}): is --base the weights the ONNX file was exported with?")
        value = full.copy()
        value[where] = out.pop(name).reshape(value[where].shape)
        out[full_name] = value
    for name in meta.get("removed") or ():
        if name in base:
            out.setdefault(name, base[name])
    return notes
