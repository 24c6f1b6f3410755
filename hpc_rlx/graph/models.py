"""Model builders: plain parameters in, a Graph out (the init scheme is part of the graph).

Every builder names the data input ``x`` and the label input ``y``, and exposes the outputs
``loss`` (mean over the batch) and ``correct`` (count of right predictions in the batch).
Parameter names follow the module they belong to (``fc0.weight``, ``block1.attn.q.bias``).
"""

from __future__ import annotations

import inspect
import math
from math import prod

from hpc_rlx.base.checks import Check, is_int
from hpc_rlx.base.errors import ConfigError, check_param
from hpc_rlx.graph.builder import GraphBuilder
from hpc_rlx.graph.ir import Graph
from hpc_rlx.graph.shapes import INT

ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid")
ZEROS = {"scheme": "zeros"}
ONES = {"scheme": "ones"}


_POSITIVE_INT = Check(lambda v: is_int(v) and v >= 1, "must be a positive int")
_INT_OR_ZERO = Check(lambda v: is_int(v) and v >= 0, "must be an int >= 0")
_PROBABILITY = Check(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0,
                     "must be in [0, 1)")
_BOOL = Check(lambda v: isinstance(v, bool), "must be true or false")

# A bad argument is a ConfigError that names it (`errors.check_param`: `dropout must be in [0, 1)`,
# the name kept apart from the text), which config.spec restates as the config key (`model.dropout`).


def _pos_int(value, name: str, qualifier: str = "") -> int:
    return check_param(_POSITIVE_INT, name, value, qualifier=qualifier)


def _int_list(value, name: str, allow_empty: bool = True, qualifier: str = "") -> list:
    if is_int(value):
        value = [value]
    check_param(Check(lambda v: isinstance(v, (list, tuple)) and (bool(v) or allow_empty),
                      "must be a list of positive ints"), name, value, qualifier=qualifier)
    return [_pos_int(v, name, qualifier) for v in value]


def _shape(value, name: str, ndim: int | None = None, qualifier: str = "") -> list:
    dims = _int_list(value, name, allow_empty=False, qualifier=qualifier)
    if ndim is not None:
        check_param(Check(lambda v: len(dims) == ndim, f"must have {ndim} dims"), name, value, qualifier=qualifier)
    return dims


def _prob(value, name: str) -> float:
    return float(check_param(_PROBABILITY, name, value))


def _choice(value, name: str, allowed) -> str:
    return check_param(Check(lambda v: v in allowed, f"must be one of {list(allowed)}"), name, value)


def _weight_init(activation: str, fan_in: int, fan_out: int) -> dict:
    if activation in ("relu", "gelu"):
        return {"scheme": "he_normal", "fan_in": fan_in}
    return {"scheme": "xavier_uniform", "fan_in": fan_in, "fan_out": fan_out}


def _head(b: GraphBuilder, h: str, d_in: int, num_classes: int, y: str) -> None:
    w = b.param("head.weight", [d_in, num_classes], {"scheme": "xavier_uniform", "fan_in": d_in, "fan_out": num_classes})
    bias = b.param("head.bias", [num_classes], ZEROS)
    logits = b.op("linear", h, w, bias, name="logits")
    b.output("loss", b.op("softmax_cross_entropy", logits, y, name="xent"))
    b.output("correct", b.op("correct_count", logits, y, name="correct"))


def mlp(input_shape, num_classes=10, hidden=(128,), activation="relu", dropout=0.0, loss="cross_entropy") -> Graph:
    """Flatten, then ``linear -> activation [-> dropout]`` per hidden width, then a linear head.

    ``loss="mse"`` makes a regressor: ``y`` is float (B, num_classes) and there is no
    ``correct`` metric.
    """
    shape = _shape(input_shape, "input_shape")
    num_classes = _pos_int(num_classes, "num_classes")
    hidden = _int_list(hidden, "hidden")
    activation = _choice(activation, "activation", ACTIVATIONS)
    p = _prob(dropout, "dropout")
    loss = _choice(loss, "loss", ("cross_entropy", "mse"))
    b = GraphBuilder("mlp", meta={"builder": "mlp", "args": {
        "input_shape": shape, "num_classes": num_classes, "hidden": hidden,
        "activation": activation, "dropout": p, "loss": loss}})
    x = b.input("x", [None, *shape])
    y = b.input("y", [None] if loss == "cross_entropy" else [None, num_classes], INT if loss == "cross_entropy" else "float")
    h = b.op("flatten", x, name="flatten") if len(shape) > 1 else x
    d_in = prod(shape)
    for i, width in enumerate(hidden):
        w = b.param(f"fc{i}.weight", [d_in, width], _weight_init(activation, d_in, width))
        bias = b.param(f"fc{i}.bias", [width], ZEROS)
        h = b.op(activation, b.op("linear", h, w, bias, name=f"fc{i}"), name=f"act{i}")
        if p > 0:
            h = b.op("dropout", h, name=f"drop{i}", p=p)
        d_in = width
    if loss == "cross_entropy":
        _head(b, h, d_in, num_classes, y)
    else:
        w = b.param("head.weight", [d_in, num_classes], {"scheme": "xavier_uniform", "fan_in": d_in, "fan_out": num_classes})
        bias = b.param("head.bias", [num_classes], ZEROS)
        out = b.op("linear", h, w, bias, name="prediction")
        b.output("loss", b.op("mse", out, y, name="mse"))
    return b.build()


def cnn(input_shape, num_classes=10, channels=(16, 32), kernel=3, hidden=64, pool="max", activation="relu",
        dropout=0.0) -> Graph:
    """Per entry of ``channels``: conv (same padding) -> activation -> 2x2 pool (while the map is
    at least 2x2); then flatten -> linear ``hidden`` -> activation [-> dropout] -> linear head.
    ``hidden=0`` goes straight from the features to the head."""
    c, h, w = _shape(input_shape, "input_shape", 3, qualifier=" (C, H, W)")
    num_classes = _pos_int(num_classes, "num_classes")
    channels = _int_list(channels, "channels")
    k = _pos_int(kernel, "kernel")
    check_param(_INT_OR_ZERO, "hidden", hidden)
    pool = _choice(pool, "pool", ("max", "avg", "none"))
    activation = _choice(activation, "activation", ACTIVATIONS)
    p = _prob(dropout, "dropout")
    b = GraphBuilder("cnn", meta={"builder": "cnn", "args": {
        "input_shape": [c, h, w], "num_classes": num_classes, "channels": channels, "kernel": k,
        "hidden": hidden, "pool": pool, "activation": activation, "dropout": p}})
    x = b.input("x", [None, c, h, w])
    y = b.input("y", [None], INT)
    t = x
    for i, out_c in enumerate(channels):
        wt = b.param(f"conv{i}.weight", [out_c, c, k, k], _weight_init(activation, c * k * k, out_c * k * k))
        bias = b.param(f"conv{i}.bias", [out_c], ZEROS)
        t = b.op("conv2d", t, wt, bias, name=f"conv{i}", stride=1, padding=k // 2)
        t = b.op(activation, t, name=f"act{i}")
        _, c, h, w = b.type_of(t).shape
        if pool != "none" and h >= 2 and w >= 2:
            t = b.op(f"{pool}_pool2d", t, name=f"pool{i}", kernel=2)
            _, c, h, w = b.type_of(t).shape
    t = b.op("flatten", t, name="flatten")
    d = c * h * w
    if hidden:
        wt = b.param("fc.weight", [d, hidden], _weight_init(activation, d, hidden))
        bias = b.param("fc.bias", [hidden], ZEROS)
        t = b.op(activation, b.op("linear", t, wt, bias, name="fc"), name="fc_act")
        if p > 0:
            t = b.op("dropout", t, name="fc_drop", p=p)
        d = hidden
    _head(b, t, d, num_classes, y)
    return b.build()


def transformer_lm(vocab_size, seq_len, d_model=64, n_heads=4, n_layers=2, d_ff=256, dropout=0.0,
                   tie_embeddings=False) -> Graph:
    """A decoder-only (GPT-2 style, pre-layer-norm) language model over token ids.

    ``x`` and ``y`` are int64 (B, seq_len); ``y`` holds the next tokens. The loss is the mean
    cross-entropy over every position; ``correct`` counts right next-token guesses.
    """
    V = _pos_int(vocab_size, "vocab_size")
    T = _pos_int(seq_len, "seq_len")
    D = _pos_int(d_model, "d_model")
    H = _pos_int(n_heads, "n_heads")
    L = _pos_int(n_layers, "n_layers")
    F = _pos_int(d_ff, "d_ff")
    p = _prob(dropout, "dropout")
    check_param(_BOOL, "tie_embeddings", tie_embeddings)
    if D % H:
        raise ConfigError.bad_param("d_model", f"={D} must be divisible by n_heads={H}")
    Dh = D // H
    b = GraphBuilder("transformer_lm", meta={"builder": "transformer_lm", "args": {
        "vocab_size": V, "seq_len": T, "d_model": D, "n_heads": H, "n_layers": L, "d_ff": F,
        "dropout": p, "tie_embeddings": tie_embeddings}})
    normal = {"scheme": "normal", "std": 0.02}
    resid = {"scheme": "normal", "std": 0.02 / math.sqrt(2 * L)}  # GPT-2: scale residual projections

    def drop(t, name):
        return b.op("dropout", t, name=name, p=p) if p > 0 else t

    def lin(t, prefix, d_in, d_out, init):
        wt = b.param(f"{prefix}.weight", [d_in, d_out], init)
        bias = b.param(f"{prefix}.bias", [d_out], ZEROS)
        return b.op("linear", t, wt, bias, name=prefix)

    def norm(t, prefix):
        g = b.param(f"{prefix}.gamma", [D], ONES)
        beta = b.param(f"{prefix}.beta", [D], ZEROS)
        return b.op("layer_norm", t, g, beta, name=prefix, eps=1e-5)

    x = b.input("x", [None, T], INT)
    y = b.input("y", [None, T], INT)
    tok = b.param("tok_emb", [V, D], normal)
    pos = b.param("pos_emb", [T, D], {"scheme": "normal", "std": 0.01})
    h = b.op("add", b.op("embedding", x, tok, name="tok"), pos, name="embed")
    h = drop(h, "embed_drop")
    for i in range(L):
        pre = f"block{i}"
        a = norm(h, f"{pre}.ln1")

        def heads(name, axes):
            t = lin(a, f"{pre}.attn.{name}", D, D, normal)
            t = b.op("reshape", t, name=f"{pre}.attn.{name}_split", shape=[None, T, H, Dh])
            return b.op("transpose", t, name=f"{pre}.attn.{name}_heads", axes=axes)

        q = heads("q", [0, 2, 1, 3])  # (B, H, T, Dh)
        k = heads("k", [0, 2, 3, 1])  # (B, H, Dh, T)
        v = heads("v", [0, 2, 1, 3])
        s = b.op("matmul", q, k, name=f"{pre}.attn.scores")
        s = b.op("scale", s, name=f"{pre}.attn.scaled", value=1.0 / math.sqrt(Dh))
        s = b.op("causal_mask", s, name=f"{pre}.attn.masked")
        att = drop(b.op("softmax", s, name=f"{pre}.attn.probs", axis=-1), f"{pre}.attn.drop")
        o = b.op("matmul", att, v, name=f"{pre}.attn.mix")
        o = b.op("transpose", o, name=f"{pre}.attn.merge_heads", axes=[0, 2, 1, 3])
        o = b.op("reshape", o, name=f"{pre}.attn.merged", shape=[None, T, D])
        o = drop(lin(o, f"{pre}.attn.out", D, D, resid), f"{pre}.attn.out_drop")
        h = b.op("add", h, o, name=f"{pre}.attn_residual")
        f = lin(norm(h, f"{pre}.ln2"), f"{pre}.mlp.fc", D, F, normal)
        f = b.op("gelu", f, name=f"{pre}.mlp.act")
        f = drop(lin(f, f"{pre}.mlp.proj", F, D, resid), f"{pre}.mlp.drop")
        h = b.op("add", h, f, name=f"{pre}.mlp_residual")
    h = norm(h, "ln_f")
    if tie_embeddings:
        head = b.op("transpose", tok, name="tok_emb_t", axes=[1, 0])
        logits = b.op("linear", h, head, name="logits")
    else:
        head = b.param("head.weight", [D, V], normal)
        logits = b.op("linear", h, head, name="logits")
    # (B, T, V): classes last; where V == T the shapes alone cannot tell (graph JSON unchanged otherwise)
    side = {"axis": -1} if V == T else {}
    b.output("loss", b.op("softmax_cross_entropy", logits, y, name="xent", **side))
    b.output("correct", b.op("correct_count", logits, y, name="correct", **side))
    return b.build()


def _from_file(path) -> Graph:
    return Graph.from_file(path)


BUILDERS = {"mlp": mlp, "cnn": cnn, "transformer_lm": transformer_lm, "file": _from_file}


def build_model(kind: str, **kwargs) -> Graph:
    """``build_model("mlp", input_shape=(64,), num_classes=10, hidden=[128])``; ``kind="file"``
    with ``path=...`` loads a graph JSON file instead."""
    if kind not in BUILDERS:
        raise ConfigError(f"unknown model kind {kind!r} (known: {', '.join(BUILDERS)})")
    fn = BUILDERS[kind]
    sig = inspect.signature(fn)
    unknown = sorted(set(kwargs) - set(sig.parameters))
    if unknown:
        raise ConfigError(f"model '{kind}' does not take {unknown} (it takes {list(sig.parameters)})")
    missing = [n for n, p in sig.parameters.items() if p.default is inspect.Parameter.empty and n not in kwargs]
    if missing:
        raise ConfigError(f"model '{kind}' needs {missing}")
    return fn(**kwargs)
