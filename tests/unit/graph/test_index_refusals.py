"""What the import of the index ops (hpc_rlx/graph/onnx/map_index.py) refuses, each as one
GraphError naming the ONNX node: NonZero other than as pooling at one token per row (by both
exporters, and in hand-written graphs), scatter reductions other than none and add on data,
indexing along the batch dim, and an export that fixed its batch size (TorchScript's
``t[:, 0] = vector``, which ONNX Runtime too runs at that batch size only)."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx.importer import import_onnx

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

EOS, VOCAB, DIM = 2, 50, 6


def _model(nodes, inits=(), x_type=TensorProto.INT64, x_shape=("batch", 7), out="y"):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info(out, 0, None)],
                              initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()


def _torch_models():
    torch = pytest.importorskip("torch")
    nn = torch.nn

    class Base(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 3)

    class SumAtToken(Base):      # every hit summed over the batch: no row of its own
        def forward(self, x):
            return self.head(self.embed(x)[x.eq(EOS)].sum(0, keepdim=True).expand(x.shape[0], -1))

    class MeanOfHits(Base):      # per row, but the hits averaged rather than one taken
        def forward(self, x):
            h = self.embed(x)
            return self.head(h[x.eq(EOS), :].view(h.size(0), -1, DIM).mean(1))

    class HitPositions(Base):    # the positions themselves used as numbers
        def forward(self, x):
            return self.head(self.embed(x).mean(1)) * torch.nonzero(x.eq(EOS))[:, 1:].float().mean()

    return {"sum": (SumAtToken, "ReduceSum", "rows"), "mean": (MeanOfHits, "ReduceMean", "per_row"),
            "positions": (HitPositions, "Slice", "transposed")}


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("case", ["sum", "mean", "positions"])
def test_nonzero_outside_the_pooling_pattern_is_refused(tmp_path, exporter, case):
    torch = pytest.importorskip("torch")
    from tests.support import onnx_zoo as zoo

    module, reader, stage = _torch_models()[case]
    x = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    x[:, -1] = EOS
    path = zoo.export(module().eval(), x, tmp_path / "m.onnx", exporter, "eval", optimize=False)
    with pytest.raises(GraphError) as err:
        import_onnx(path)
    msg = str(err.value)
    assert msg.startswith("ONNX node '") and f"({reader})" in msg, msg
    assert f"reads NonZero's output (at stage '{stage}')" in msg and "pooling at one token per row" in msg, msg


def test_nonzero_of_other_ranks_and_as_an_output_is_refused():
    eq = helper.make_node("Equal", ["x", "eos"], ["mask"], name="is_eos")
    inits = [("eos", np.array(EOS, np.int64))]
    with pytest.raises(GraphError, match=r"^ONNX node 'hits' \(NonZero\): NonZero of a tensor of dims .*only a "
                                         r"\(batch, sequence\) mask"):
        import_onnx(_model([eq, helper.make_node("NonZero", ["mask"], ["y"], name="hits")], inits,
                           x_shape=("batch", 3, 4)))
    with pytest.raises(GraphError, match=r"^ONNX node 'hits' \(NonZero\): its output reaches the graph "
                                         r"output 'y' \(at stage 'transposed'\)"):
        import_onnx(_model([eq, helper.make_node("NonZero", ["mask"], ["nz"], name="hits"),
                            helper.make_node("Transpose", ["nz"], ["y"], perm=[1, 0])], inits))


@pytest.mark.parametrize("op_type", ["ScatterElements", "ScatterND"])
@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
def test_scatter_reductions_other_than_none_and_add_are_refused_on_data(op_type, reduction):
    """On data (the run-time ops do none and add); on constants they fold (test_index_ops)."""
    idx = np.zeros((3, 2), np.int64) if op_type == "ScatterElements" else np.array([[0], [2]], np.int64)
    upd = np.ones((3, 2) if op_type == "ScatterElements" else (2, 7), np.float32)
    m = _model([helper.make_node(op_type, ["x", "idx", "upd"], ["y"], name="scatter", reduction=reduction,
                                 **({"axis": 1} if op_type == "ScatterElements" else {}))],
               [("idx", idx), ("upd", upd)], x_type=TensorProto.FLOAT, x_shape=(3, 7))
    with pytest.raises(GraphError, match=rf"^ONNX node 'scatter' \({op_type}\): reduction '{reduction}' on data "
                                         r"is not supported \(none and add are\)"):
        import_onnx(m)


def test_indexing_along_the_batch_is_refused():
    floats = dict(x_type=TensorProto.FLOAT, x_shape=("batch", 7))
    cases = [
        ([helper.make_node("CumSum", ["x", "ax"], ["y"], name="running")], [("ax", np.array(0, np.int64))],
         r"'running' \(CumSum\): CumSum along axis 0, which holds the batch"),
        ([helper.make_node("GatherElements", ["x", "idx"], ["y"], name="pick", axis=0)],
         [("idx", np.zeros((2, 7), np.int64))], r"'pick' \(GatherElements\): GatherElements along axis 0"),
        ([helper.make_node("GatherND", ["x", "idx"], ["y"], name="tuples")], [("idx", np.zeros((2, 2), np.int64))],
         r"'tuples' \(GatherND\): index tuples address axis 0 of the data, which holds the batch"),
    ]
    for nodes, inits, pattern in cases:
        with pytest.raises(GraphError, match="^ONNX node " + pattern):
            import_onnx(_model(nodes, inits, **floats))


def test_an_export_that_fixed_its_batch_size_is_refused_by_name(tmp_path):
    """TorchScript writes ``d[:, 0] = vector`` as an Expand of the vector to the export's batch
    size, a constant: ONNX Runtime runs the file at that batch size only, and the import says
    so at the node (``vector.expand_as(d[:, 0])`` exports against the batch, test_index_ops)."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from tests.support import onnx_zoo as zoo

    class StartVector(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.start = torch.nn.Embedding(VOCAB, DIM), torch.nn.Parameter(torch.randn(DIM))

        def forward(self, x):
            d = self.embed(x).clone()
            d[:, 0] = self.start
            return d.mean(1)

    path = zoo.export(StartVector(), torch.randint(0, VOCAB, (3, 7)), tmp_path / "m.onnx", "torchscript", "eval")
    session = ort.InferenceSession(str(path))
    assert session.run(None, {"x": np.zeros((3, 7), np.int64)})[0].shape == (3, DIM)
    with pytest.raises(Exception, match="expand"):
        session.run(None, {"x": np.zeros((4, 7), np.int64)})
    with pytest.raises(GraphError, match=r"^ONNX node '[^']+' \(Expand\): Expand of a tensor of dims \[3, 6\] .*"
                                         r"the model fixes its batch size at 3, the size it was exported at"):
        import_onnx(path)
