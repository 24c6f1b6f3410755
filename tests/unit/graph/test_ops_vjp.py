"""Every op's VJP against central finite differences in float64 (broadcast shapes, odd sizes)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import OPS, Executor, GraphBuilder, ParamLayout, build_model, init_params, register_op, unregister_op
from hpc_rlx.graph.gradcheck import GradCheckError, check_grads, check_op
from hpc_rlx.graph.registry import defvjp
from hpc_rlx.graph.shapes import TensorType

R = np.random.default_rng(7)


def n(*shape):
    return R.standard_normal(shape)


def ids(high, *shape):
    return R.integers(0, high, shape)


# (op, args, attrs): float args are differentiated, int args are fed as data
CASES = [
    ("relu", [n(3, 5)], {}),
    ("tanh", [n(2, 3, 5)], {}),
    ("sigmoid", [5 * n(3, 7)], {}),
    ("gelu", [2 * n(3, 5)], {}),
    ("scale", [n(2, 3)], {"value": -1.7}),
    ("dropout", [n(4, 5)], {"p": 0.3}),
    ("add", [n(3, 1, 5), n(4, 1)], {}),
    ("add", [n(2, 3), n(3)], {}),
    ("sub", [n(1, 3), n(5, 1)], {}),
    ("mul", [n(3, 1, 5), n(4, 1)], {}),
    ("div", [n(3, 4), 2 + R.random((1, 4))], {}),
    ("bias_add", [n(2, 3, 4, 5), n(3)], {"axis": 1}),
    ("bias_add", [n(5, 7), n(7)], {}),
    ("matmul", [n(3, 4), n(4, 5)], {}),
    ("matmul", [n(2, 3, 4), n(4, 5)], {}),
    ("matmul", [n(2, 1, 3, 4), n(3, 4, 2)], {}),
    ("matmul", [n(3, 4), n(2, 4, 5)], {}),
    ("linear", [n(3, 4), n(4, 5), n(5)], {}),
    ("linear", [n(2, 3, 4), n(4, 5)], {}),
    ("conv2d", [n(2, 3, 7, 6), n(4, 3, 3, 2), n(4)], {"stride": [2, 1], "padding": [1, 0]}),
    ("conv2d", [n(1, 2, 5, 5), n(3, 2, 3, 3)], {"stride": 1, "padding": 1}),
    ("conv2d", [n(2, 1, 6, 6), n(2, 1, 2, 2)], {"stride": 2}),
    # transposed convolution: stride, padding, output_padding, dilation, groups, with and without bias
    ("conv_transpose2d", [n(2, 3, 4, 5), n(3, 2, 3, 3), n(2)], {"stride": 2, "padding": 1, "output_padding": 1}),
    ("conv_transpose2d", [n(2, 4, 3, 4), n(4, 3, 2, 3)], {"stride": [2, 1], "padding": [0, 1], "groups": 2}),
    ("conv_transpose2d", [n(1, 4, 3, 3), n(4, 1, 3, 2), n(4)],
     {"stride": 3, "padding": [2, 1], "output_padding": [2, 1], "dilation": [2, 1], "groups": 4}),
    ("conv_transpose2d", [n(2, 2, 4, 3), n(2, 3, 1, 1)], {}),
    # padding: each mode, negative pads (a crop) beside positive ones
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 1, 2, 0, 0, 0, 1, 3], "value": 0.7}),
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 0, -1, 2, 0, 0, 1, -2]}),
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 0, 3, 1, 0, 0, 2, 4], "mode": "reflect"}),
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 0, -1, 2, 0, 0, 2, -1], "mode": "reflect"}),
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 0, 5, 0, 0, 0, 2, 3], "mode": "edge"}),
    ("pad", [n(2, 3, 4, 5)], {"pads": [0, 0, 6, -1, 0, 0, 1, 7], "mode": "wrap"}),
    # resizing: nearest (whole and uneven factors, every rounding), linear in every coordinate mode, up and down
    ("resize", [n(2, 3, 3, 4)], {"size": [6, 8], "coordinates": "asymmetric", "nearest_mode": "floor"}),
    ("resize", [n(2, 3, 5, 4)], {"size": [7, 3]}),
    ("resize", [n(2, 2, 5, 4)], {"size": [3, 9], "nearest_mode": "round_prefer_ceil", "coordinates": "align_corners"}),
    ("resize", [n(2, 2, 5, 4)], {"size": [8, 2], "nearest_mode": "ceil", "coordinates": "half_pixel_symmetric"}),
    ("resize", [n(2, 3, 3, 4)], {"size": [7, 8], "mode": "linear"}),
    ("resize", [n(2, 3, 6, 5)], {"size": [4, 2], "mode": "linear", "coordinates": "pytorch_half_pixel"}),
    ("resize", [n(2, 3, 4, 5)], {"size": [9, 5], "mode": "linear", "coordinates": "align_corners"}),
    ("resize", [n(2, 2, 4, 5)], {"size": [6, 7], "mode": "linear", "coordinates": "asymmetric", "scales": [1.5, 1.4]}),
    ("resize", [n(2, 2, 4, 5)], {"size": [6, 3], "mode": "linear", "coordinates": "half_pixel_symmetric",
                                 "scales": [1.6, 0.7]}),
    ("resize", [n(2, 2, 7)], {"size": [4], "mode": "linear"}),  # 1-D
    ("resize", [n(1, 2, 3, 2, 4)], {"size": [5, 3, 2], "mode": "linear"}),  # 3-D
    ("max_pool2d", [n(2, 3, 7, 5)], {"kernel": 2}),
    ("max_pool2d", [n(2, 2, 6, 6)], {"kernel": 3, "stride": 2, "padding": 1}),
    ("avg_pool2d", [n(2, 3, 7, 5)], {"kernel": [2, 3], "stride": 1}),
    ("avg_pool2d", [n(1, 2, 5, 5)], {"kernel": 3, "stride": 2, "padding": 1}),
    ("flatten", [n(2, 3, 4)], {}),
    ("reshape", [n(6, 4)], {"shape": [3, -1, 2]}),
    ("transpose", [n(2, 3, 4)], {"axes": [2, 0, 1]}),
    ("sum", [n(3, 4, 5)], {"axes": [0, 2]}),
    ("sum", [n(3, 4)], {}),
    ("mean", [n(3, 4, 5)], {"axes": [1], "keepdims": True}),
    ("mean", [n(3, 4)], {}),
    ("embedding", [ids(5, 3, 4), n(5, 3)], {}),  # repeated ids accumulate
    ("layer_norm", [n(3, 4, 7), n(7), n(7)], {}),
    ("layer_norm", [n(5, 3), n(3), n(3)], {"eps": 1e-3}),
    ("softmax", [n(3, 5)], {}),
    ("softmax", [n(3, 5, 2)], {"axis": 1}),
    # A small fill keeps the finite-difference loss well scaled; the default fill takes the same path.
    ("causal_mask", [n(2, 4, 4)], {"fill": -3.0}),
    ("softmax_cross_entropy", [n(6, 5), ids(5, 6)], {}),
    ("softmax_cross_entropy", [n(2, 3, 5), ids(5, 2, 3)], {}),
    ("mse", [n(3, 4), n(3, 4)], {}),
    # index ops (more cases, and PyTorch as the oracle, in tests/unit/graph/test_index_ops.py)
    ("cumsum", [n(3, 5)], {"axis": 1, "exclusive": True, "reverse": True}),
    ("gather_elements", [n(4, 5), ids(4, 6, 5) - 2], {"axis": 0}),  # repeats, negative indices
    ("gather_nd", [n(3, 5, 2), ids(5, 3, 4, 1)], {"batch_dims": 1}),
    ("scatter_elements", [n(3, 6), ids(6, 3, 4) - 3, n(3, 4)], {"axis": 1, "reduction": "add"}),
    ("scatter_nd", [n(5, 3), np.array([[4], [-5], [2]]), n(3, 3)], {}),
]


@pytest.mark.parametrize("op,args,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_vjp_matches_finite_differences(op, args, attrs):
    report = check_op(op, args, attrs, train=True)  # train=True: dropout active with a fixed mask
    float_args = [a for a in args if np.asarray(a).dtype.kind == "f"]
    assert len(report) == len(float_args)


def test_every_differentiable_op_is_checked():
    from tests.unit.graph.test_onnx_ops import CHECKED as checked_there  # the ops ONNX import added

    checked = {c[0] for c in CASES} | checked_there
    assert set(OPS) - checked == {"correct_count"}  # a metric: integer output, no gradient


def test_checker_catches_a_wrong_vjp():
    def fwd(xp, args, a, ctx):
        return args[0] * args[0], None

    register_op("square_wrong", fwd, lambda t, a: t[0], (1, 1))
    defvjp("square_wrong", lambda xp, g, args, ans, s, a, out: g * args[0])  # should be 2 * x * g
    try:
        with pytest.raises(GradCheckError, match="arg0"):
            check_op("square_wrong", [n(3, 2)])
    finally:
        unregister_op("square_wrong")


def test_missing_vjp_names_the_op():
    def fwd(xp, args, a, ctx):
        return args[0] * 2.0, None

    register_op("double_novjp", fwd, lambda t, a: t[0], (1, 1))
    try:
        b = GraphBuilder()
        b.input("x", [None, 3])
        b.input("y", [None], "int64")
        w = b.param("w", [3, 2], {"scheme": "normal", "std": 1.0})
        h = b.op("double_novjp", b.op("matmul", "x", w), name="twice")
        b.output("loss", b.op("softmax_cross_entropy", h, "y"))
        g = b.build()
        with pytest.raises(GraphError, match="node 'twice': op 'double_novjp' has no VJP"):
            Executor(g)
    finally:
        unregister_op("double_novjp")


def test_missing_vjp_for_one_argument_names_it():
    def fwd(xp, args, a, ctx):
        return args[0] * args[1], None

    register_op("mul_half", fwd, lambda t, a: t[0], (2, 2), arg_names=("x", "scale"))
    defvjp("mul_half", lambda xp, g, args, ans, s, a, out: g * args[1], None)
    try:
        b = GraphBuilder()
        b.input("x", [None, 3])
        w = b.param("w", [3], {"scheme": "ones"})
        b.output("loss", b.op("sum", b.op("mul_half", "x", w, name="m")))
        with pytest.raises(GraphError, match="op 'mul_half' has no VJP for argument 'scale'"):
            Executor(b.build())
    finally:
        unregister_op("mul_half")


def test_whole_models_pass_gradcheck():
    """Ops composed: residuals, shared weights (tied embeddings), dropout, pooling."""
    cases = [
        (build_model("transformer_lm", vocab_size=11, seq_len=5, d_model=8, n_heads=2, n_layers=2, d_ff=12,
                     dropout=0.2, tie_embeddings=True),
         {"x": ids(11, 3, 5), "y": ids(11, 3, 5)}),
        (build_model("cnn", input_shape=(2, 6, 5), num_classes=4, channels=[3, 4], kernel=3, hidden=6,
                     pool="max", dropout=0.3),
         {"x": n(3, 2, 6, 5), "y": ids(4, 3)}),
        (build_model("cnn", input_shape=(1, 5, 5), num_classes=3, channels=[2], kernel=2, hidden=0, pool="avg",
                     activation="tanh"),
         {"x": n(2, 1, 5, 5), "y": ids(3, 2)}),
        (build_model("mlp", input_shape=(2, 3), num_classes=3, hidden=[5, 4], activation="sigmoid"),
         {"x": n(4, 2, 3), "y": ids(3, 4)}),
        (build_model("mlp", input_shape=(3,), num_classes=2, hidden=[4], activation="gelu", loss="mse"),
         {"x": n(5, 3), "y": n(5, 2)}),
    ]
    for g, feeds in cases:
        layout = ParamLayout(g)
        flat = np.empty(layout.size)
        init_params(g, flat, 0)
        flat += 0.1 * R.standard_normal(flat.size)  # no exact zeros (biases, LN beta) to hide errors
        check_grads(g, layout.views(flat), feeds, train=True)


def test_infer_rules_reject_bad_shapes():
    from hpc_rlx.graph.shapes import ShapeError

    f = TensorType((None, 3, 8, 8), "float")
    with pytest.raises(ShapeError, match="channels"):
        OPS["conv2d"].infer([f, TensorType((4, 2, 3, 3), "float")], OPS["conv2d"].normalise({}))
    with pytest.raises(ShapeError, match="does not fit"):
        OPS["max_pool2d"].infer([TensorType((None, 1, 1, 1), "float")], OPS["max_pool2d"].normalise({"kernel": 2}))
    with pytest.raises(ShapeError, match="reshape"):
        OPS["reshape"].infer([TensorType((None, 6), "float")], OPS["reshape"].normalise({"shape": [None, 4]}))
    with pytest.raises(ShapeError, match="broadcast"):
        OPS["add"].infer([TensorType((None, 3), "float"), TensorType((4,), "float")], {})
    with pytest.raises(ShapeError, match="divisible|reshape|batch"):
        OPS["reshape"].infer([TensorType((None, 6), "float")], OPS["reshape"].normalise({"shape": [6, -1]}))
