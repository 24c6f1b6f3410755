"""ONNX -> IR for the recurrent layers ``LSTM``, ``GRU`` and ``RNN`` (see ``map_math`` for the
mapping convention; the IR ops are in ``hpc_rlx.graph.ops.recurrent``).

The IR ops run batch first and pack Y, Y_h (and Y_c) into one tensor; the mapping moves the
batch of ``layout=0`` tensors ((T, B, I) input, (D, B, H) states) to the front, fills omitted
inputs that precede a given one, and slices the outputs back apart in the file's layout.
Attributes the IR does not have are refused with the node named: ``clip``, ``input_forget``,
activation parameters, activations other than Sigmoid, Tanh and Relu, and LSTM peepholes
(``P``), which PyTorch never exports.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.graph.onnx.emit import Tensor
from hpc_rlx.graph.onnx.fold import Folded
from hpc_rlx.graph.onnx.map_math import cast_to, float_tensor
from hpc_rlx.graph.ops.recurrent import ACTIVATIONS, DIRECTIONS, KINDS

# ONNX input positions
X, W, R, B, SEQUENCE_LENS, INITIAL_H, INITIAL_C, P = range(8)


def _input(ins, k):
    return ins[k] if len(ins) > k else None


def _is_zero(v) -> bool:
    return isinstance(v, Folded) and v.const and not np.asarray(v.value).any()


def _batch_first(em, v, layout: int, what: str) -> Tensor:
    """A rank-3 tensor with the batch moved to the front from where ``layout`` puts it."""
    t = float_tensor(em, v, what)
    batch_at = 1 if layout == 0 else 0
    if t.rank != 3 or t.batch_axis != batch_at or not all(t.plain(i) for i in range(3) if i != batch_at):
        raise em.fail(f"{what} must be rank 3 with the batch in axis {batch_at} (layout={layout}) and the other "
                      f"dims static, got IR dims {t.groups}")
    return em.transpose(t, [1, 0, 2]) if batch_at else t


def _attributes(em, kind: str, at: dict) -> dict:
    for name in ("clip", "activation_alpha", "activation_beta"):
        if name in at:
            raise em.fail(f"attribute {name!r} is not supported")
    if at.get("input_forget", 0):
        raise em.fail("input_forget=1 (coupled input and forget gates) is not supported")
    direction = at.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise em.fail(f"direction {direction!r} is not one of {sorted(DIRECTIONS)}")
    attrs = {"direction": direction}
    if "activations" in at:
        acts = [a.lower() for a in at["activations"]]
        unknown = sorted({a for a in acts if a not in ACTIVATIONS})
        if unknown:
            raise em.fail(f"activations {unknown} are not supported (only Sigmoid, Tanh and Relu)")
        per_direction, defaults = KINDS[kind][1], KINDS[kind][2]
        d = DIRECTIONS[direction]
        if len(acts) == per_direction and d == 2:  # one direction's list serves both (ONNX Runtime)
            acts = acts * 2
        if acts != list(defaults) * d:
            attrs["activations"] = acts
    if kind == "gru":
        attrs["linear_before_reset"] = bool(at.get("linear_before_reset", 0))
    return attrs


def recurrent(kind: str):
    gates, _, _, states = KINDS[kind]

    def emit(em, ins, at, n):
        if kind == "lstm" and _input(ins, P) is not None and not _is_zero(ins[P]):
            raise em.fail("LSTM peepholes (input P) are not supported")
        layout = int(at.get("layout", 0))
        attrs = _attributes(em, kind, at)
        d = DIRECTIONS[attrs["direction"]]
        x = _batch_first(em, ins[X], layout, "input X")
        steps = x.groups[1][0]
        w, r = float_tensor(em, ins[W], "W"), float_tensor(em, ins[R], "R")
        if r.rank != 3 or not all(r.plain(i) for i in range(3)):
            raise em.fail(f"R must be a static (directions, {gates}*hidden, hidden) tensor, got IR dims {r.groups}")
        hidden = r.groups[2][0]
        if "hidden_size" in at and at["hidden_size"] != hidden:
            raise em.fail(f"hidden_size={at['hidden_size']} disagrees with R's shape {r.ir_shape}")

        zeros_state = ((None,), (d,), (hidden,))
        given = {
            "b": None if _input(ins, B) is None or _is_zero(ins[B]) else float_tensor(em, ins[B], "B"),
            "h0": None if _input(ins, INITIAL_H) is None or _is_zero(ins[INITIAL_H])
            else _batch_first(em, ins[INITIAL_H], layout, "initial_h"),
            "c0": None if kind != "lstm" or _input(ins, INITIAL_C) is None or _is_zero(ins[INITIAL_C])
            else _batch_first(em, ins[INITIAL_C], layout, "initial_c"),
            "lens": _lengths(em, _input(ins, SEQUENCE_LENS), steps),
        }
        names = ("b", "h0", "c0", "lens") if kind == "lstm" else ("b", "h0", "lens")
        last = max((i for i, name in enumerate(names) if given[name] is not None), default=-1)
        args = [x, w, r]
        for name in names[:last + 1]:
            v = given[name]
            if v is None:  # an omitted input before a given one: ONNX's default, zeros
                v = (em.constant(np.zeros((d, 2 * gates * hidden), np.float32)) if name == "b"
                     else em.with_batch(em.constant(np.zeros((1, d, hidden), np.float32)), zeros_state))
            args.append(v)
        packed = em.tensor(kind, args, ((None,), (steps + states,), (d,), (hidden,)), **attrs)

        def rows(start, stop):
            return em.tensor("slice", [packed], ((None,), (stop - start,), (d,), (hidden,)),
                             axes=[1], starts=[start], ends=[stop])

        outs = []
        for k, name in enumerate(list(em.proto.output)[:n] if em.proto is not None else [""] * n):
            if not name or k > states:
                outs.append(None)
            elif k == 0:
                y = rows(0, steps)
                outs.append(em.transpose(y, [1, 2, 0, 3]) if layout == 0 else y)
            else:
                state = em.reshape(rows(steps + k - 1, steps + k), zeros_state)
                outs.append(em.transpose(state, [1, 0, 2]) if layout == 0 else state)
        return outs

    return emit


def _lengths(em, v, steps: int):
    """``sequence_lens`` as an int64 (batch,) tensor, or None where every row is full length."""
    if v is None:
        return None
    if isinstance(v, Folded) and v.const:
        if np.all(np.asarray(v.value) == steps):
            return None
        raise em.fail("a constant sequence_lens must hold the sequence length; per-row lengths must come "
                      "from the data (they have the batch dim)")
    if isinstance(v, Folded) and np.all(v.a == steps) and np.all(v.b == steps):
        return None
    t = em.as_tensor(v)
    if t.rank != 1 or t.groups[0] != (None,):
        raise em.fail(f"sequence_lens must be (batch,), got IR dims {t.groups}")
    if t.dtype != "int64":
        t = cast_to(em, t, np.int64)
    return t


lstm = recurrent("lstm")
gru = recurrent("gru")
rnn = recurrent("rnn")
