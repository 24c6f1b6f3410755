"""Recurrent layers ``lstm``, ``gru`` and ``rnn`` with the ONNX operators' semantics (conventions
in ``hpc_rlx.graph.ops``), batch first.

Arguments (trailing ones optional; an argument before a given one must be given too):

- ``x`` (B, T, I): the sequence;
- ``w`` (D, G*H, I) and ``r`` (D, G*H, H): input and recurrent weights per direction, gates in
  ONNX's order (LSTM ``i o f c``, GRU ``z r h``, RNN one gate), D = 2 for ``bidirectional``;
- ``b`` (D, 2*G*H): the input biases then the recurrent biases (zeros when absent);
- ``h0`` (B, D, H), and for ``lstm`` ``c0`` (B, D, H): the initial states (zeros when absent);
- ``lens`` (B,) int64: each row's length; steps at or past it leave the state alone and output
  zeros, a reverse direction runs from the row's last valid step back to step 0, and a row of
  length 0 ends in zero states (as ONNX Runtime does); lengths above T count as T. No gradient.

The output packs ONNX's three outputs in ONNX's ``layout=1`` form, along the time axis:
``(B, T + S, D, H)`` with Y in rows ``[0, T)``, the final hidden state Y_h in row T and, for
``lstm``, the final cell state Y_c in row T + 1 (S = 2 for ``lstm``, 1 otherwise); the importer
slices them apart.

``activations`` lists each direction's functions in ONNX's order (LSTM f, g, h; GRU f, g; RNN
f; forward direction first), from ``sigmoid``, ``tanh`` and ``relu``; the default is ONNX's
(sigmoid and tanh; tanh for the RNN). ``gru``'s ``linear_before_reset`` applies the reset gate
after the recurrent product (PyTorch's form) instead of before.

The forward runs an explicit loop over time and keeps each step's gate values; the VJP is
backpropagation through time over them, computed once for all arguments.
"""

from __future__ import annotations

from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import INT, ShapeError, TensorType, fmt_shape, require_float

DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}
ACTIVATIONS = ("sigmoid", "tanh", "relu")
# kind -> (gates, activations per direction, defaults, final states packed after Y)
KINDS = {
    "lstm": (4, 3, ("sigmoid", "tanh", "tanh"), 2),
    "gru": (3, 2, ("sigmoid", "tanh"), 1),
    "rnn": (1, 1, ("tanh",), 1),
}
ARG_NAMES = {"lstm": ("x", "w", "r", "b", "h0", "c0", "lens"), "gru": ("x", "w", "r", "b", "h0", "lens"),
             "rnn": ("x", "w", "r", "b", "h0", "lens")}


# ---------------------------------------------------------------- activations


def activate(xp, name, v):
    if name == "sigmoid":
        e = xp.exp(-xp.abs(v))  # never overflows
        out = 1.0 / (1.0 + e)
        return xp.where(v >= 0, out, e * out)
    if name == "tanh":
        return xp.tanh(v)
    return xp.maximum(v, 0.0)


def activation_slope(name, y):
    """The derivative of activation ``name`` where its output is ``y``."""
    if name == "sigmoid":
        return y * (1.0 - y)
    if name == "tanh":
        return 1.0 - y * y
    return (y > 0).astype(y.dtype)


# ---------------------------------------------------------------- attributes and types


def _check(kind):
    per_direction, defaults = KINDS[kind][1], KINDS[kind][2]

    def check(a):
        direction = a["direction"]
        if direction not in DIRECTIONS:
            raise ShapeError(f"attribute 'direction' must be one of {sorted(DIRECTIONS)}, got {direction!r}")
        d = DIRECTIONS[direction]
        acts = a["activations"]
        if acts is None:
            acts = list(defaults) * d
        if not isinstance(acts, (list, tuple)) or len(acts) != per_direction * d or not all(
                isinstance(f, str) and f.lower() in ACTIVATIONS for f in acts):
            raise ShapeError(f"attribute 'activations' must list {per_direction * d} of {list(ACTIVATIONS)} "
                             f"({per_direction} per direction), got {acts!r}")
        out = {"direction": direction, "activations": [f.lower() for f in acts]}
        if kind == "gru":
            lbr = a["linear_before_reset"]
            if not isinstance(lbr, bool):
                raise ShapeError(f"attribute 'linear_before_reset' must be true or false, got {lbr!r}")
            out["linear_before_reset"] = lbr
        return out

    return check


def _batch_matches(a, b) -> bool:
    return a is None or b is None or a == b


def _type(kind):
    gates, states = KINDS[kind][0], KINDS[kind][3]
    names = ARG_NAMES[kind]

    def rule(types, a):
        x, w, r = types[:3]
        for t, what in zip(types[:3], names):
            require_float(t, what)
        if x.ndim != 3 or x.shape[1] is None or x.shape[2] is None:
            raise ShapeError(f"{kind} input x must be (batch, T, I) with known T and I, got {fmt_shape(x.shape)}")
        batch, steps, features = x.shape
        d = DIRECTIONS[a["direction"]]
        if r.ndim != 3 or r.shape[0] != d or r.shape[2] is None or r.shape[1] != gates * r.shape[2]:
            raise ShapeError(f"{kind} r must be ({d}, {gates}*H, H), got {fmt_shape(r.shape)}")
        hidden = r.shape[2]
        if w.shape != (d, gates * hidden, features):
            raise ShapeError(f"{kind} w must be {fmt_shape((d, gates * hidden, features))}, got {fmt_shape(w.shape)}")
        expected = {"b": (d, 2 * gates * hidden), "h0": (batch, d, hidden), "c0": (batch, d, hidden),
                    "lens": (batch,)}
        for t, what in zip(types[3:], names[3:]):
            if what == "lens":
                if t.dtype != INT or t.ndim != 1 or not _batch_matches(t.shape[0], batch):
                    raise ShapeError(f"{kind} lens must be int64 (batch,), got {t}")
                continue
            require_float(t, what)
            want = expected[what]
            if t.ndim != len(want) or not all(_batch_matches(u, v) if i == 0 and what != "b" else u == v
                                              for i, (u, v) in enumerate(zip(t.shape, want))):
                raise ShapeError(f"{kind} {what} must be {fmt_shape(want)}, got {fmt_shape(t.shape)}")
        return TensorType((batch, steps + states, d, hidden), x.dtype)

    return rule


# ---------------------------------------------------------------- one direction, one cell kind


def _carry(xp, valid, s, new, old):
    """The state carried past step ``s``: ``new`` in rows still inside their length, ``old`` held
    in rows already past it."""
    return new if valid is None else xp.where(valid[:, s:s + 1], new, old)


def _emit(xp, ys, valid, s, h_new):
    """Step ``s``'s output: the new state, zeros in rows past their length."""
    ys[:, s] = h_new if valid is None else xp.where(valid[:, s:s + 1], h_new, 0.0)


def _split_grad(xp, valid, s, total, through):
    """A state's cotangent at step ``s`` split into what reaches the step (rows inside their
    length) and what passes it by to the step before (rows past it, whose state was held)."""
    if valid is None:
        return total, None
    m = valid[:, s:s + 1]
    return xp.where(m, total, 0.0), xp.where(m, 0.0, through)


def _lstm_forward(xp, xs, rw, rb, h, c, valid, acts, keep):
    """Steps over ``xs`` (B, T, 4H): the input projections with their bias, in step order."""
    f, g, hf = acts
    n, steps, _ = xs.shape
    hidden = h.shape[1]
    ys = xp.empty((n, steps, hidden), dtype=xs.dtype)
    saved = [] if keep else None
    rt = rw.T
    for s in range(steps):
        a = xs[:, s] + h @ rt
        a += rb
        i = activate(xp, f, a[:, :hidden])
        o = activate(xp, f, a[:, hidden:2 * hidden])
        fg = activate(xp, f, a[:, 2 * hidden:3 * hidden])
        cc = activate(xp, g, a[:, 3 * hidden:])
        c_new = fg * c + i * cc
        hc = activate(xp, hf, c_new)
        h_new = o * hc
        if keep:
            saved.append((i, o, fg, cc, hc, h, c))
        _emit(xp, ys, valid, s, h_new)
        h, c = _carry(xp, valid, s, h_new, h), _carry(xp, valid, s, c_new, c)
    return ys, (h, c), saved


def _lstm_backward(xp, gys, gh, gc, rw, saved, valid, acts):
    f, g, hf = acts
    n, steps, hidden = gys.shape
    dxs = xp.empty((n, steps, 4 * hidden), dtype=gys.dtype)
    drw = xp.zeros_like(rw)
    dh, dc = gh, gc
    for s in range(steps - 1, -1, -1):
        i, o, fg, cc, hc, h_prev, c_prev = saved[s]
        dhn, dcn = dh + gys[:, s], dc
        dhn, held_h = _split_grad(xp, valid, s, dhn, dh)
        dcn, held_c = _split_grad(xp, valid, s, dcn, dc)
        dcell = dcn + dhn * o * activation_slope(hf, hc)
        da = dxs[:, s]
        da[:, :hidden] = dcell * cc * activation_slope(f, i)
        da[:, hidden:2 * hidden] = dhn * hc * activation_slope(f, o)
        da[:, 2 * hidden:3 * hidden] = dcell * c_prev * activation_slope(f, fg)
        da[:, 3 * hidden:] = dcell * i * activation_slope(g, cc)
        drw += da.T @ h_prev
        dh, dc = da @ rw, dcell * fg
        if valid is not None:
            dh += held_h
            dc += held_c
    return dxs, drw, dxs.sum(axis=(0, 1)), (dh, dc)


def _gru_forward(xp, xs, rw, rb, h, valid, acts, keep, before_reset):
    f, g = acts
    n, steps, _ = xs.shape
    hidden = h.shape[1]
    ys = xp.empty((n, steps, hidden), dtype=xs.dtype)
    saved = [] if keep else None
    r_zr, r_h = rw[:2 * hidden].T, rw[2 * hidden:].T
    rb_zr, rb_h = rb[:2 * hidden], rb[2 * hidden:]
    for s in range(steps):
        x = xs[:, s]
        a = x[:, :2 * hidden] + h @ r_zr
        a += rb_zr
        z = activate(xp, f, a[:, :hidden])
        r = activate(xp, f, a[:, hidden:])
        if before_reset:
            lin = h @ r_h
            lin += rb_h
            hh = activate(xp, g, x[:, 2 * hidden:] + r * lin)
        else:
            lin = None
            pre = (r * h) @ r_h
            pre += rb_h
            pre += x[:, 2 * hidden:]
            hh = activate(xp, g, pre)
        h_new = hh + z * (h - hh)
        if keep:
            saved.append((z, r, hh, lin, h))
        _emit(xp, ys, valid, s, h_new)
        h = _carry(xp, valid, s, h_new, h)
    return ys, (h,), saved


def _gru_backward(xp, gys, gh, rw, saved, valid, acts, before_reset):
    f, g = acts
    n, steps, hidden = gys.shape
    dxs = xp.empty((n, steps, 3 * hidden), dtype=gys.dtype)
    drw = xp.zeros_like(rw)
    drb_h = xp.zeros((hidden,), dtype=gys.dtype)
    r_zr, r_h = rw[:2 * hidden], rw[2 * hidden:]
    dh = gh
    for s in range(steps - 1, -1, -1):
        z, r, hh, lin, h_prev = saved[s]
        dhn = dh + gys[:, s]
        dhn, held = _split_grad(xp, valid, s, dhn, dh)
        da = dxs[:, s]
        dah = dhn * (1.0 - z) * activation_slope(g, hh)
        da[:, 2 * hidden:] = dah
        dh = dhn * z
        if before_reset:
            dlin = dah * r
            dr = dah * lin
            drw[2 * hidden:] += dlin.T @ h_prev
            drb_h += dlin.sum(axis=0)
            dh += dlin @ r_h
        else:
            drw[2 * hidden:] += dah.T @ (r * h_prev)
            drb_h += dah.sum(axis=0)
            dq = dah @ r_h
            dr = dq * h_prev
            dh += dq * r
        da[:, :hidden] = dhn * (h_prev - hh) * activation_slope(f, z)
        da[:, hidden:2 * hidden] = dr * activation_slope(f, r)
        dzr = da[:, :2 * hidden]
        drw[:2 * hidden] += dzr.T @ h_prev
        dh += dzr @ r_zr
        if valid is not None:
            dh += held
    drb = xp.concatenate([dxs[..., :2 * hidden].sum(axis=(0, 1)), drb_h])
    return dxs, drw, drb, (dh,)


def _rnn_forward(xp, xs, rw, rb, h, valid, acts, keep):
    (f,) = acts
    n, steps, hidden = xs.shape
    ys = xp.empty((n, steps, hidden), dtype=xs.dtype)
    saved = [] if keep else None
    rt = rw.T
    for s in range(steps):
        a = xs[:, s] + h @ rt
        a += rb
        h_new = activate(xp, f, a)
        if keep:
            saved.append((h_new, h))
        _emit(xp, ys, valid, s, h_new)
        h = _carry(xp, valid, s, h_new, h)
    return ys, (h,), saved


def _rnn_backward(xp, gys, gh, rw, saved, valid, acts):
    (f,) = acts
    n, steps, hidden = gys.shape
    dxs = xp.empty((n, steps, hidden), dtype=gys.dtype)
    drw = xp.zeros_like(rw)
    dh = gh
    for s in range(steps - 1, -1, -1):
        h_new, h_prev = saved[s]
        dhn = dh + gys[:, s]
        dhn, held = _split_grad(xp, valid, s, dhn, dh)
        da = dhn * activation_slope(f, h_new)
        dxs[:, s] = da
        drw += da.T @ h_prev
        dh = da @ rw
        if valid is not None:
            dh += held
    return dxs, drw, dxs.sum(axis=(0, 1)), (dh,)


# ---------------------------------------------------------------- the op


def _step_order(xp, lens, n, steps, reverse):
    """(B, T) time index of each row's step s, or None for time order: a reverse direction
    runs each row backwards over its valid steps; steps past a row's length keep their place.
    The map is its own inverse."""
    if not reverse:
        return None
    s = xp.arange(steps)[None, :]
    if lens is None:
        return xp.broadcast_to(steps - 1 - s, (n, steps))
    length = lens[:, None]
    return xp.where(s < length, length - 1 - s, s)


def _reorder(xp, v, order):
    return v if order is None else xp.take_along_axis(v, order[:, :, None], axis=1)


def _split_args(kind, args):
    x, w, r = args[:3]
    rest = dict(zip(ARG_NAMES[kind][3:], args[3:]))
    return x, w, r, rest.get("b"), rest.get("h0"), rest.get("c0"), rest.get("lens")


def _forward(kind):
    gates, _, _, states = KINDS[kind]
    per_direction = KINDS[kind][1]

    def forward(xp, args, a, ctx):
        x, w, r, b, h0, c0, lens = _split_args(kind, args)
        n, steps, _ = x.shape
        d, hidden = w.shape[0], r.shape[2]
        keep = ctx.need_saved
        if lens is not None:
            lens = xp.clip(lens, 0, steps)
            valid = xp.arange(steps)[None, :] < lens[:, None]
        else:
            valid = None
        out = xp.zeros((n, steps + states, d, hidden), dtype=x.dtype)
        kept = []
        for k in range(d):
            reverse = a["direction"] == "reverse" or k == 1
            order = _step_order(xp, lens, n, steps, reverse)
            acts = a["activations"][k * per_direction:(k + 1) * per_direction]
            xs = x @ w[k].T
            if b is not None:
                xs += b[k, :gates * hidden]
            xs = _reorder(xp, xs, order)
            rb = b[k, gates * hidden:] if b is not None else xp.zeros((gates * hidden,), dtype=x.dtype)
            h = h0[:, k] if h0 is not None else xp.zeros((n, hidden), dtype=x.dtype)
            if kind == "lstm":
                c = c0[:, k] if c0 is not None else xp.zeros((n, hidden), dtype=x.dtype)
                ys, final, saved = _lstm_forward(xp, xs, r[k], rb, h, c, valid, acts, keep)
            elif kind == "gru":
                ys, final, saved = _gru_forward(xp, xs, r[k], rb, h, valid, acts, keep, a["linear_before_reset"])
            else:
                ys, final, saved = _rnn_forward(xp, xs, r[k], rb, h, valid, acts, keep)
            out[:, :steps, k] = _reorder(xp, ys, order)
            for j, state in enumerate(final):
                # a row of length 0 ends in zeros, not its initial state (ONNX Runtime)
                out[:, steps + j, k] = state if lens is None else xp.where(valid[:, :1], state, 0.0)
            kept.append((order, acts, saved))
        return out, ({"valid": valid, "directions": kept, "grads": None} if keep else None)

    return forward


def _all_grads(kind, xp, g, args, saved, a):
    """Every argument's cotangent, by backpropagation through time; computed on the first
    argument's call and reused by the others (the executor calls them with the same ``g``)."""
    cached = saved["grads"]
    if cached is not None and cached[0] is g:
        return cached[1]
    gates, _, _, states = KINDS[kind]
    x, w, r, b, h0, c0, lens = _split_args(kind, args)
    n, steps, _ = x.shape
    d, hidden = w.shape[0], r.shape[2]
    valid = saved["valid"]
    dx = xp.zeros_like(x)
    dw, dr = xp.zeros_like(w), xp.zeros_like(r)
    db = xp.zeros((d, 2 * gates * hidden), dtype=x.dtype)
    dh0 = xp.zeros((n, d, hidden), dtype=x.dtype)
    dc0 = xp.zeros((n, d, hidden), dtype=x.dtype) if kind == "lstm" else None
    for k, (order, acts, steps_saved) in enumerate(saved["directions"]):
        gys = _reorder(xp, g[:, :steps, k], order)
        finals = [g[:, steps + j, k] for j in range(states)]
        if valid is not None:  # rows of length 0: their final states are zeros
            finals = [xp.where(valid[:, :1], gf, 0.0) for gf in finals]
        gh = finals[0]
        if kind == "lstm":
            dxs, drw, drb, first = _lstm_backward(xp, gys, gh, finals[1], r[k], steps_saved, valid, acts)
            dc0[:, k] = first[1]
        elif kind == "gru":
            dxs, drw, drb, first = _gru_backward(xp, gys, gh, r[k], steps_saved, valid, acts,
                                                 a["linear_before_reset"])
        else:
            dxs, drw, drb, first = _rnn_backward(xp, gys, gh, r[k], steps_saved, valid, acts)
        dh0[:, k] = first[0]
        dxs = _reorder(xp, dxs, order)
        flat = dxs.reshape(-1, gates * hidden)
        dw[k] = flat.T @ x.reshape(-1, x.shape[2])
        dx += dxs @ w[k]
        dr[k] = drw
        db[k, :gates * hidden] = flat.sum(axis=0)
        db[k, gates * hidden:] = drb
    grads = {"x": dx, "w": dw, "r": dr, "b": db, "h0": dh0, "c0": dc0}
    saved["grads"] = (g, grads)
    return grads


def _vjp(kind, what):
    def fn(xp, g, args, ans, saved, a, out):
        return _all_grads(kind, xp, g, args, saved, a)[what]

    return fn


for _kind in KINDS:
    _attrs = {"direction": "forward", "activations": None}
    if _kind == "gru":
        _attrs["linear_before_reset"] = False
    _arity = (3, len(ARG_NAMES[_kind]))
    defop(_kind, _type(_kind), _arity, attrs=_attrs, check=_check(_kind), arg_names=ARG_NAMES[_kind])(
        _forward(_kind))
    # lens carries no gradient
    defvjp(_kind, *[None if name == "lens" else _vjp(_kind, name) for name in ARG_NAMES[_kind]],
           needs_args=(0, 1, 2))
