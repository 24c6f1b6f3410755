"""A graph of several inputs imported with `inputs` (data.x=[...]): one packed input cut apart
again, each dataset bound to the input of its name or else in order; one input more and a
scalar output is a graph with its own loss; what does not fit is one GraphError naming both."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.data.model_inputs import pack_rows
from hpc_rlx.graph import Executor

onnx = pytest.importorskip("onnx")

from hpc_rlx.graph.onnx.importer import import_onnx  # noqa: E402
from tests.support.onnx_checks import param_views  # noqa: E402

H = onnx.helper
WA = np.arange(4, dtype=np.float32).reshape(2, 2) / 5
WB = np.arange(6, dtype=np.float32).reshape(3, 2) / 7


def _model(own_loss: bool = False) -> bytes:
    """out = a @ WA + float(b) @ WB, with a (batch, 2) float and b (batch, 3) int64 (a mask, say);
    with own_loss, a third input `target` and the scalar mean squared error as an output."""
    nodes = [H.make_node("MatMul", ["a", "wa"], ["pa"]), H.make_node("Cast", ["b"], ["bf"], to=1),
             H.make_node("MatMul", ["bf", "wb"], ["pb"]), H.make_node("Add", ["pa", "pb"], ["out"])]
    inputs = [H.make_tensor_value_info("a", 1, ["batch", 2]), H.make_tensor_value_info("b", 7, ["batch", 3])]
    outputs = [H.make_tensor_value_info("out", 1, ["batch", 2])]
    if own_loss:
        nodes += [H.make_node("Sub", ["out", "target"], ["d"]), H.make_node("Mul", ["d", "d"], ["sq"]),
                  H.make_node("ReduceMean", ["sq"], ["mse"], keepdims=0)]
        inputs.append(H.make_tensor_value_info("target", 1, ["batch", 2]))
        outputs.insert(0, H.make_tensor_value_info("mse", 1, []))
    inits = [onnx.numpy_helper.from_array(WA, "wa"), onnx.numpy_helper.from_array(WB, "wb")]
    graph = H.make_graph(nodes, "two_inputs", inputs, outputs, initializer=inits)
    return H.make_model(graph, opset_imports=[H.make_opsetid("", 17)]).SerializeToString()


def _data(n: int = 5):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 2)), rng.integers(0, 2, (n, 3)).astype(np.int64)


def _forward(imported, x: np.ndarray) -> np.ndarray:
    g = imported.graph
    layout, flat = param_views(imported, g, "float64")
    node = g.meta["onnx"]["output_node"]
    return Executor(g, np, "float64").run(layout.views(flat), {"x": x}, [node], train=False)[node]


@pytest.mark.parametrize("datasets", [[("p", (2,), "float64"), ("q", (3,), "int64")],     # in order
                                      [("b", (3,), "int64"), ("a", (2,), "float64")]])    # by name
def test_each_dataset_feeds_the_input_of_its_name_or_else_the_next_in_order(datasets):
    a, b = _data()
    imported = import_onnx(_model(), label_dtype="int64", label_shape=(), inputs=datasets)
    x_in = imported.graph.input("x")
    assert x_in.shape == (None, 5) and x_in.dtype == "float"      # float64 rows: `a` holds floats
    rows = pack_rows([b, a] if datasets[0][0] == "b" else [a, b], np.float64)
    want = a @ WA.astype(np.float64) + b @ WB.astype(np.float64)
    assert np.abs(_forward(imported, rows) - want).max() <= 1e-12


def test_integer_inputs_pack_as_int64_and_keep_their_values():
    ids = np.array([[3, 2 ** 40], [0, 7]], dtype=np.int64)
    mask = np.array([[1, 0], [1, 1]], dtype=np.int32)
    packed = pack_rows([ids, mask], np.int64)
    assert packed.dtype == np.int64 and packed.tolist() == [[3, 2 ** 40, 1, 0], [0, 7, 1, 1]]
    assert pack_rows([ids[:0], mask[:0]], np.int64).shape == (0, 4)     # a rank without rows


def test_one_input_more_and_a_scalar_output_is_a_graph_with_its_own_loss():
    imported = import_onnx(_model(own_loss=True), inputs=[("a", (2,), "float64"), ("b", (3,), "int64")])
    g = imported.graph
    assert set(g.outputs) == {"loss"} and g.input("y").shape == (None, 2) and g.input("x").shape == (None, 5)
    a, b = _data()
    target = np.ones((5, 2))
    layout, flat = param_views(imported, g, "float64")
    out = Executor(g, np, "float64").forward_backward(layout.views(flat), layout.views(np.zeros_like(flat)),
                                                      {"x": pack_rows([a, b], np.float64), "y": target})
    d = a @ WA.astype(np.float64) + b @ WB.astype(np.float64) - target
    assert out["loss"] == pytest.approx((d * d).mean(), rel=1e-12)


@pytest.mark.parametrize("datasets, message", [
    ([("a", (2,), "float64"), ("b", (3,), "int64"), ("c", (1,), "int64"), ("d", (1,), "int64")],
     r"data\.x names 4 datasets \['a', 'b', 'c', 'd'\], but the ONNX graph has 2 data inputs \['a', 'b'\]"),
    ([("a", (2,), "float64"), ("b", (4,), "int64")],
     r"data\.x dataset 'b' has rows of shape \(4,\), but the ONNX input 'b' it feeds takes \(3,\)"),
    ([("a", (2,), "float64"), ("b", (3,), "float32")],
     r"data\.x dataset 'b' holds float32, but the ONNX input 'b' it feeds takes integers"),
])
def test_a_count_shape_or_dtype_that_does_not_fit_is_one_error_naming_both_sides(datasets, message):
    with pytest.raises(GraphError, match=message):
        import_onnx(_model(), inputs=datasets)


def test_each_packed_input_that_indexes_an_embedding_is_checked_against_its_own_table(tmp_path):
    """BERT's three inputs: token ids (a 20-row table), token types (a 2-row table) and a mask
    (read through arithmetic): the ids and the types each against their own table, the mask
    against none."""
    torch = pytest.importorskip("torch")
    from hpc_rlx.base.errors import DataError
    from hpc_rlx.data.hdf5 import TokenVocab, check_values
    from hpc_rlx.graph.onnx.packed_inputs import input_vocabs

    class ThreeInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.types, self.head = (torch.nn.Embedding(20, 4), torch.nn.Embedding(2, 4),
                                                  torch.nn.Linear(4, 3))

        def forward(self, input_ids, token_type_ids, attention_mask):
            h = (self.tokens(input_ids) + self.types(token_type_ids)) * attention_mask[..., None].float()
            return self.head(h.sum(1))

    names = ["input_ids", "token_type_ids", "attention_mask"]
    ids = torch.zeros(2, 6, dtype=torch.long)
    path = tmp_path / "three.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ThreeInputs(), (ids, ids, ids), str(path), dynamo=False, input_names=names,
                          output_names=["logits"], dynamic_axes={n: {0: "batch"} for n in names})
    imported = import_onnx(str(path), label_dtype="int64", label_shape=(),
                           inputs=[(n, (6,), "int64") for n in names])
    vocabs = [TokenVocab(rows, table, (a, b)) for a, b, rows, table in input_vocabs(imported.graph)]
    assert [(v.columns, v.size) for v in vocabs] == [((0, 6), 20), ((6, 12), 2)]
    rows = np.zeros((4, 18), np.int64)
    rows[:, :6], rows[:, 12:] = 19, 7          # ids inside the 20 rows; the mask bounds nothing
    check_values(rows, np.zeros(4, np.int64), None, False, vocab=vocabs)
    rows[2, 8] = 2                             # a token type past the 2-row table
    with pytest.raises(DataError, match=r"token id 2 at row 12 is outside the vocabulary \[0, 2\) of the "
                                        r"embedding '[^']*types[^']*'"):
        check_values(rows, np.zeros(4, np.int64), None, False, first_row=10, vocab=vocabs)


def test_a_model_of_two_inputs_imported_for_one_says_to_name_both_in_data_x():
    with pytest.raises(GraphError, match=r"no output is a float scalar; a model of several inputs .* takes them "
                                         r"all named: data\.x=\[input_ids,attention_mask\]"):
        import_onnx(_model())
