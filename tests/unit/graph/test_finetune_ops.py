"""The ops the models people fine-tune need beyond the others: ``argmax`` (a decoder-only
classifier's last non-padding token), ``sign`` (DeBERTa-v2's relative positions),
``instance_norm`` (PyTorch's GroupNorm as both exporters write it) and ONNX Tile on data (by a
constant, or by the batch size as DeBERTa repeats its keys per sample), each against PyTorch
(float64, <= 1e-10) and ONNX Runtime on one-node files (float32); the per-row pick
``logits[arange(batch), index]`` in a dynamo file without its optimizer (the form with Max)
against ONNX Runtime; and what the import refuses around them, each as one error naming the
node. Their VJPs against finite differences are in test_onnx_ops.CASES; the models, by both
exporters, in test_onnx_import (the project's zoo) and test_hf_models (transformers)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Executor, GraphBuilder

from tests.unit.graph.test_onnx_ops import run_op

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402

from tests.support.onnx_checks import param_views, rel  # noqa: E402

R = np.random.default_rng(48)
TOL64, TOL32 = 1e-10, 3e-5


def n(*shape):
    return R.standard_normal(shape)


def _file(nodes, x_shape, x_type=TensorProto.FLOAT, inits=(), as_float=False) -> bytes:
    """A one-input file whose nodes write "out" (with ``as_float``, "res", then cast to float:
    the import puts a loss on a float output)."""
    if as_float:
        nodes = nodes + [helper.make_node("Cast", ["res"], ["out"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _ours_and_ort(model, x: np.ndarray, loss="auto"):
    """(our forward in float32 in the file's shape, ONNX Runtime's) of a file's output on ``x``."""
    imported = import_onnx(model, loss=loss)
    g = imported.graph
    layout, flat = param_views(imported, g, "float32")
    node = g.meta["onnx"]["output_node"]
    ours = Executor(g, np, "float32").run(layout.views(flat), {"x": x}, [node])[node]
    ref = ort.InferenceSession(model).run(None, {"x": x})[0]
    return ours.reshape(ref.shape), ref  # a dim merging several IR dims (Tile's copies) as one


# ---------------------------------------------------------------- the IR ops against PyTorch


@pytest.mark.parametrize("shape, eps", [((3, 4, 5), 1e-5), ((2, 3, 4, 5), 1e-3), ((2, 2, 3, 2, 2), 1e-5)])
def test_instance_norm_matches_torch(shape, eps):
    x, scale, bias = n(*shape), n(shape[1]), n(shape[1])
    value, _, grads, w = run_op("instance_norm", [x, scale, bias], {"eps": eps})
    tx, ts, tb = (torch.tensor(a, requires_grad=True) for a in (x, scale, bias))
    ref = torch.nn.functional.instance_norm(tx, weight=ts, bias=tb, eps=eps)
    (ref * torch.tensor(w)).sum().backward()
    assert rel(value, ref.detach().numpy()) <= TOL64
    for i, t in enumerate((tx, ts, tb)):
        assert rel(grads[i], t.grad.numpy()) <= TOL64, i


def _run(op, x, **attrs):
    b = GraphBuilder()
    b.input("x", list(x.shape), "int64" if x.dtype.kind == "i" else "float")
    out = b.op(op, "x", name="out", **attrs)
    b.output("loss", b.op("sum", b.op("cast", out, to="float")))
    return Executor(b.build(), np, "float64").run({}, {"x": x}, "out")["out"]


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_argmax_takes_the_first_or_last_largest_entry(dtype):
    x = R.integers(0, 4, (5, 6, 7)).astype(dtype)          # many ties
    for axis in (0, 1, -1):
        got = _run("argmax", x, axis=axis)
        np.testing.assert_array_equal(got, torch.argmax(torch.tensor(x), dim=axis).numpy())
        assert got.dtype == np.int64
        kept = _run("argmax", x, axis=axis, keepdims=True, select_last_index=True)
        flipped = np.flip(x, axis).argmax(axis)
        np.testing.assert_array_equal(kept, np.expand_dims(x.shape[axis] - 1 - flipped, axis))


def test_sign_of_ints_and_floats_follows_torch_with_no_gradient():
    ints = R.integers(-3, 4, (4, 6))
    np.testing.assert_array_equal(_run("sign", ints), torch.sign(torch.tensor(ints)).numpy())
    x = np.concatenate([n(3, 5), np.zeros((1, 5))])
    value, _, grads, _ = run_op("sign", [x], {})
    np.testing.assert_array_equal(value, torch.sign(torch.tensor(x)).numpy())
    assert not grads[0].any()


# ---------------------------------------------------------------- one-node files against ONNX Runtime


@pytest.mark.parametrize("x_type", [TensorProto.FLOAT, TensorProto.INT64])
@pytest.mark.parametrize("attrs", [{}, {"axis": 1, "keepdims": 0}, {"axis": -1, "select_last_index": 1}])
def test_argmax_on_data_matches_onnxruntime(x_type, attrs):
    x = R.integers(0, 3, (4, 5, 6))
    x = x.astype(np.float32) if x_type == TensorProto.FLOAT else x
    model = _file([helper.make_node("ArgMax", ["x"], ["res"], **{"axis": 1, **attrs})], ["batch", 5, 6], x_type,
                  as_float=True)
    ours, ref = _ours_and_ort(model, x)
    np.testing.assert_array_equal(ours, ref)


def test_argmax_and_sign_of_constants_are_folded():
    """On constants the import evaluates them (ONNX's rules: keepdims by default, the last
    largest with select_last_index) and gathers x at the result."""
    table = np.array([[3, 1, 3], [0, -2, 2]], np.int64)
    nodes = [helper.make_node("ArgMax", ["t"], ["first"], axis=1, keepdims=0),
             helper.make_node("ArgMax", ["t"], ["last"], axis=1, select_last_index=1),
             helper.make_node("Sign", ["t"], ["signs"]),
             helper.make_node("ReduceSum", ["signs"], ["total"], keepdims=0),
             helper.make_node("Reshape", ["last", "flat"], ["last1"]),
             helper.make_node("Reshape", ["total", "flat"], ["total1"]),
             helper.make_node("Concat", ["first", "last1", "total1"], ["at"], axis=0),
             helper.make_node("Gather", ["x", "at"], ["out"], axis=1)]
    model = _file(nodes, ["batch", 6], inits=[("t", table), ("flat", np.array([-1]))])
    g = import_onnx(model).graph
    assert not {"argmax", "sign"} & {node.op for node in g.nodes}
    x = n(3, 6).astype(np.float32)
    ours, ref = _ours_and_ort(model, x, loss="mse")
    np.testing.assert_array_equal(ours, ref)
    np.testing.assert_array_equal(ours, x[:, [0, 2, 2, 2, 3]])


@pytest.mark.parametrize("x_type", [TensorProto.FLOAT, TensorProto.INT64])
def test_sign_on_data_matches_onnxruntime(x_type):
    x = R.integers(-2, 3, (4, 6))
    x = (x * R.random((4, 6))).astype(np.float32) if x_type == TensorProto.FLOAT else x
    ours, ref = _ours_and_ort(_file([helper.make_node("Sign", ["x"], ["res"])], ["batch", 6], x_type, as_float=True), x)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("shape", [(3, 4, 10), (2, 6, 3, 4)])
def test_instance_normalization_matches_onnxruntime(shape):
    c = shape[1]
    model = _file([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["out"], epsilon=1e-3)],
                  ["batch", *shape[1:]], inits=[("s", n(c).astype(np.float32)), ("b", n(c).astype(np.float32))])
    ours, ref = _ours_and_ort(model, n(*shape).astype(np.float32))
    assert rel(ours, ref) <= TOL32


def _tile_by_batch(t_shape=(2, 3, 4)) -> bytes:
    """out = Tile(t, [batch, 1, 1]) * x[:, :1, None] from an initializer t: DeBERTa's keys
    repeated per sample (the batch of a (batch*2, 3, 4) result is outermost)."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"], end=1),
             helper.make_node("Concat", ["xs", "ones"], ["reps"], axis=0),
             helper.make_node("Tile", ["t", "reps"], ["tiled"]),
             helper.make_node("Reshape", ["tiled", "to4"], ["per_sample"]),
             helper.make_node("Slice", ["x", "zero", "one", "one"], ["first"]),
             helper.make_node("Unsqueeze", ["first", "axes23"], ["scale"]),
             helper.make_node("Mul", ["per_sample", "scale"], ["out"])]
    inits = [("t", n(*t_shape).astype(np.float32)), ("ones", np.ones(len(t_shape) - 1, np.int64)),
             ("to4", np.array([-1, *t_shape], np.int64)), ("zero", np.array([0])), ("one", np.array([1])),
             ("axes23", np.array([2, 3]))]
    return _file(nodes, ["batch", 3], inits=inits)


def test_tile_on_data_matches_onnxruntime_and_sums_the_copies_in_its_gradient():
    x = n(5, 3, 2).astype(np.float32)
    model = _file([helper.make_node("Tile", ["x", "reps"], ["out"])], ["batch", 3, 2],
                  inits=[("reps", np.array([1, 2, 3], np.int64))])
    ours, ref = _ours_and_ort(model, x)
    assert ours.shape == ref.shape == (5, 6, 6) and rel(ours, ref) <= TOL32
    x = n(4, 3).astype(np.float32)
    ours, ref = _ours_and_ort(_tile_by_batch(), x)
    assert ours.shape == ref.shape == (4, 2, 3, 4) and rel(ours, ref) <= TOL32
    # the gradient of the repeated initializer under an MSE loss: PyTorch's repeat in float64
    imported = import_onnx(_tile_by_batch(), loss="mse")
    g = imported.graph
    layout, flat = param_views(imported, g, "float64")
    grad = np.zeros_like(flat)
    x, y = x.astype(np.float64), n(4, 2, 3, 4)
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(grad), {"x": x, "y": y},
                                                      train=True)
    t = torch.tensor(imported.initial["t"], requires_grad=True)
    ref = t.repeat(4, 1, 1).view(4, 2, 3, 4) * torch.tensor(x)[:, :1, None, None]
    loss = torch.nn.functional.mse_loss(ref, torch.tensor(y))
    loss.backward()
    assert out["loss"] == pytest.approx(loss.item(), rel=TOL64)
    assert rel(layout.views(grad)["t"], t.grad.numpy()) <= TOL64


def test_the_per_row_pick_of_a_dynamo_file_without_its_optimizer_matches_onnxruntime(tmp_path_factory):
    """dynamo's optimize=False writes the pick's index shape as Shape(Max(arange(batch), index)):
    the import reads only that shape."""
    from tests.support import onnx_zoo as zoo
    from tests.support.shared import run_dir

    module, path = zoo.export_zoo_model("last_token", run_dir(tmp_path_factory, "onnx-zoo"), "dynamo", "train",
                                        optimize=False)
    assert "Max" in {node.op_type for node in onnx.load(str(path)).graph.node}
    x = zoo.sample_input("last_token", 5, seed=4).numpy()
    x[1, 5:] = 0                                           # rows padded at the end
    ours, ref = _ours_and_ort(str(path), x)
    assert rel(ours, ref) <= TOL32
    with torch.no_grad():
        assert rel(ours, module(torch.tensor(x)).numpy()) <= TOL32


# ---------------------------------------------------------------- refusals


def _sample_numbers(tail) -> bytes:
    """arange(batch) as dynamo writes it, unsqueezed, then ``tail`` (nodes reading "rows" with
    the int64 index "idx" = ArgMax(x) unsqueezed beside it)."""
    nodes = [helper.make_node("Shape", ["x"], ["xs"], start=0, end=1),
             helper.make_node("Squeeze", ["xs"], ["b"]),
             helper.make_node("Range", ["zero", "b", "one"], ["ar"]),
             helper.make_node("Unsqueeze", ["ar", "last"], ["rows"]),
             helper.make_node("ArgMax", ["x"], ["am"], axis=1, keepdims=0),
             helper.make_node("Unsqueeze", ["am", "last"], ["idx"])] + tail
    inits = [("zero", np.array(0)), ("one", np.array(1)), ("last", np.array([-1]))]
    return _file(nodes, ["batch", 6], inits=inits)


def test_sample_numbers_read_outside_the_per_row_pick_are_refused():
    picked = _sample_numbers([helper.make_node("Concat", ["rows", "idx"], ["tuples"], axis=-1),
                              helper.make_node("GatherND", ["x", "tuples"], ["out"])])
    x = n(4, 6).astype(np.float32)
    ours, ref = _ours_and_ort(picked, x, loss="mse")
    np.testing.assert_array_equal(ours, ref)
    as_numbers = _sample_numbers([helper.make_node("Concat", ["rows", "idx"], ["tuples"], axis=-1),
                                  helper.make_node("Cast", ["tuples"], ["out"], to=TensorProto.FLOAT)])
    with pytest.raises(GraphError, match=r"^ONNX node '.*' \(Cast\): reads the sample numbers \(arange over the "
                                         r"batch\) outside the per-row pick"):
        import_onnx(as_numbers)
    added = _sample_numbers([helper.make_node("Add", ["rows", "idx"], ["out"])])   # (B, 1), not (B,)
    with pytest.raises(GraphError, match=r"\(Add\).*cannot be made static"):
        import_onnx(added)


def test_tile_by_a_count_that_varies_otherwise_than_the_batch_is_refused():
    nodes = [helper.make_node("Shape", ["x"], ["xs"], end=1), helper.make_node("Mul", ["xs", "two"], ["b2"]),
             helper.make_node("Concat", ["b2", "one"], ["reps"], axis=0),
             helper.make_node("Tile", ["x", "reps"], ["out"], name="tile_2b")]
    model = _file(nodes, ["batch", 3], inits=[("two", np.array([2])), ("one", np.array([1]))])
    with pytest.raises(GraphError, match=r"^ONNX node 'tile_2b' \(Tile\): Tile by \['2\*batch', 1\]: each count must "
                                         r"be a constant of at least 1, or the batch size once on an input without "
                                         r"the batch"):
        import_onnx(model)


def test_instance_normalization_of_a_merged_batch_is_refused():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["flat"]),
             helper.make_node("InstanceNormalization", ["flat", "s", "b"], ["out"], name="inorm")]
    model = _file(nodes, ["batch", 2, 3, 4], inits=[("shape", np.array([-1, 3, 4])),
                                                   ("s", np.ones(3, np.float32)), ("b", np.zeros(3, np.float32))])
    with pytest.raises(GraphError, match=r"'inorm' \(InstanceNormalization\): .*batch first and on its own"):
        import_onnx(model)
