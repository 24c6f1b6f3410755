"""The graph IR: exact JSON round trips, fingerprints, and validation errors that name the node."""

from __future__ import annotations

import copy
import json

import pytest

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph import Graph, build_model
from hpc_rlx.graph.ir import SCHEMA_VERSION


def small() -> dict:
    """A hand-written two-layer classifier in the JSON form."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": "hand",
        "inputs": [
            {"name": "x", "shape": [None, 4], "dtype": "float"},
            {"name": "y", "shape": [None], "dtype": "int64"},
        ],
        "params": [
            {"name": "w0", "shape": [4, 8], "dtype": "float", "init": {"scheme": "he_normal"}},
            {"name": "b0", "shape": [8], "dtype": "float", "init": {"scheme": "zeros"}},
            {"name": "w1", "shape": [8, 3], "dtype": "float", "init": {"scheme": "xavier_uniform", "gain": 1.0}},
        ],
        "nodes": [
            {"name": "h", "op": "linear", "inputs": ["x", "w0", "b0"], "attrs": {}, "shape": [None, 8], "dtype": "float"},
            {"name": "a", "op": "relu", "inputs": ["h"], "attrs": {}, "shape": [None, 8], "dtype": "float"},
            {"name": "logits", "op": "matmul", "inputs": ["a", "w1"], "attrs": {}, "shape": [None, 3], "dtype": "float"},
            {"name": "xent", "op": "softmax_cross_entropy", "inputs": ["logits", "y"], "attrs": {}, "shape": [],
             "dtype": "float"},
            {"name": "hits", "op": "correct_count", "inputs": ["logits", "y"], "attrs": {}, "shape": [],
             "dtype": "int64"},
        ],
        "outputs": {"loss": "xent", "correct": "hits"},
        "meta": {"note": "written by hand"},
    }


def node(d, name):
    return next(n for n in d["nodes"] if n["name"] == name)


def test_hand_written_graph_loads():
    g = Graph.from_dict(small())
    assert [s.name for s in g.inputs] == ["x", "y"]
    assert g.inputs[0].shape == (None, 4) and g.inputs[1].dtype == "int64"
    assert [p.name for p in g.params] == ["w0", "b0", "w1"]
    assert g.params[0].shape == (4, 8) and g.params[0].init == {"scheme": "he_normal"}
    assert g.loss_name == "loss" and g.metric_names == ["correct"]
    assert g.num_classes == 3 and g.predictions_per_sample == 1
    assert g.num_params == 4 * 8 + 8 + 8 * 3


@pytest.mark.parametrize(
    "make",
    [
        lambda: Graph.from_dict(small()),
        lambda: build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=[16, 8], dropout=0.1),
        lambda: build_model("cnn", input_shape=(1, 8, 8), num_classes=10, channels=[4, 8], kernel=3, hidden=16),
        lambda: build_model("transformer_lm", vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=1, d_ff=16,
                            tie_embeddings=True),
    ],
)
def test_json_round_trip_is_exact(make):
    g = make()
    d = g.to_dict()
    text = g.to_json()
    g2 = Graph.from_json(text)
    assert g2.to_dict() == d
    assert g2.to_json() == text
    assert Graph.from_dict(json.loads(json.dumps(d))).to_dict() == d
    assert g2.fingerprint() == g.fingerprint() and g2 == g


def test_round_trip_keeps_node_order_and_attrs_as_written():
    d = small()
    d["nodes"].reverse()  # any order is accepted; execution order is derived
    node(d, "a")["attrs"] = {}
    g = Graph.from_dict(d)
    assert g.to_dict()["nodes"] == d["nodes"]
    assert [g.nodes[i].name for i in g.order] == ["h", "a", "logits", "hits", "xent"]


def test_fingerprint_changes_with_the_model():
    d = small()
    f0 = Graph.from_dict(d).fingerprint()
    d["params"][0]["init"] = {"scheme": "normal", "std": 0.1}
    assert Graph.from_dict(d).fingerprint() != f0
    assert len(f0) == 64 and int(f0, 16) >= 0


def test_to_dict_is_a_copy():
    g = Graph.from_dict(small())
    d = g.to_dict()
    d["params"][0]["init"]["scheme"] = "zeros"
    d["nodes"][0]["attrs"]["x"] = 1
    assert g.to_dict() == Graph.from_dict(small()).to_dict()


def test_file_round_trip(tmp_path):
    g = build_model("mlp", input_shape=(4,), num_classes=3, hidden=[5])
    path = tmp_path / "model.json"
    g.to_file(path)
    assert Graph.from_file(path) == g
    assert build_model("file", path=str(path)) == g


# ---------------------------------------------------------------- validation errors name the node


def expect(d, *fragments):
    with pytest.raises(GraphError) as err:
        Graph.from_dict(d)
    msg = str(err.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_unknown_op_names_node_and_op():
    d = small()
    node(d, "a")["op"] = "swish"
    expect(d, "node 'a'", "unknown op 'swish'")


def test_missing_reference_names_node_and_reference():
    d = small()
    node(d, "logits")["inputs"] = ["a", "w9"]
    expect(d, "node 'logits'", "'w9'", "refers to no")


def test_shape_mismatch_names_node():
    d = small()
    d["params"][2]["shape"] = [7, 3]  # logits = a(B, 8) @ w1(7, 3)
    expect(d, "node 'logits'", "(op 'matmul')", "inner dims", "(7, 3)")


def test_declared_shape_mismatch_names_node():
    d = small()
    node(d, "a")["shape"] = [None, 9]
    expect(d, "node 'a'", "declared shape (B, 9)", "(B, 8)")


def test_dtype_mismatch_names_node():
    d = small()
    d["inputs"][1]["dtype"] = "float"  # float labels into cross-entropy
    expect(d, "node 'xent'", "labels must be int64")


def test_declared_dtype_mismatch_names_node():
    d = small()
    node(d, "hits")["dtype"] = "float"
    expect(d, "node 'hits'", "declared dtype float", "int64")


def test_cycle_names_nodes_on_it():
    d = small()
    node(d, "h")["inputs"] = ["a", "w0", "b0"]  # h <- a <- h
    node(d, "h")["shape"] = [None, 8]
    d["params"][0]["shape"] = [8, 8]
    msg = expect(d, "cycle")
    assert "'h'" in msg or "'a'" in msg
    assert "h -> a -> h" in msg or "a -> h -> a" in msg


def test_missing_loss_output():
    d = small()
    d["outputs"] = {"correct": "hits"}
    expect(d, "missing the 'loss' output")


def test_loss_must_be_a_float_scalar():
    d = small()
    d["outputs"]["loss"] = "logits"
    expect(d, "output 'loss'", "node 'logits'", "scalar")
    d["outputs"]["loss"] = "hits"
    expect(d, "output 'loss'", "node 'hits'", "float")


def test_duplicate_names():
    d = small()
    node(d, "a")["name"] = "h"
    expect(d, "node 'h'", "duplicate name")
    d = small()
    d["nodes"][0]["name"] = "w0"
    expect(d, "node 'w0'", "duplicate", "parameter")
    d = small()
    d["params"][1]["name"] = "x"
    expect(d, "parameter 'x'", "duplicate", "input")


def test_bad_attrs_name_the_node():
    d = small()
    node(d, "a")["attrs"] = {"alpha": 0.1}
    expect(d, "node 'a'", "unknown attribute", "alpha")
    d = small()
    d["nodes"].insert(2, {"name": "drop", "op": "dropout", "inputs": ["a"], "attrs": {"p": 1.5},
                          "shape": [None, 8], "dtype": "float"})
    expect(d, "node 'drop'", "'p'", "1.5")


def test_wrong_arity_names_node():
    d = small()
    node(d, "a")["inputs"] = ["h", "h"]
    expect(d, "node 'a'", "takes 1 inputs, got 2")


def test_parameter_dtype_is_the_compute_dtype():
    d = small()
    del d["params"][1]["dtype"]  # optional on input, always written out
    assert Graph.from_dict(d).to_dict()["params"][1]["dtype"] == "float"
    d["params"][1]["dtype"] = "int64"
    expect(d, "parameter 'b0'", "dtype must be 'float'")


def test_bad_init_names_parameter():
    d = small()
    d["params"][0]["init"] = {"scheme": "kaiming_magic"}
    expect(d, "parameter 'w0'", "kaiming_magic")
    d["params"][0]["init"] = {"scheme": "normal"}
    expect(d, "parameter 'w0'", "needs 'std'")


def test_structure_errors():
    d = small()
    d["schema_version"] = 99
    expect(d, "schema_version 99")
    d = small()
    d["extra"] = 1
    expect(d, "unknown field", "extra")
    d = small()
    del d["nodes"][0]["dtype"]
    expect(d, "node #0", "missing field", "dtype")
    d = small()
    d["inputs"][0]["shape"] = [None, 0]
    expect(d, "input 'x'", "shape")
    d = small()
    d["outputs"]["correct"] = "w0"
    expect(d, "output 'correct'", "not a node")
    d = small()
    node(d, "a")["attrs"] = {"bad": float("nan")}
    expect(d, "node 'a'", "not plain JSON")


def test_malformed_json_and_files(tmp_path):
    with pytest.raises(GraphError, match="malformed"):
        Graph.from_json("{nope")
    missing = tmp_path / "nothere.json"
    with pytest.raises(GraphError, match="nothere.json"):
        Graph.from_file(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1,')
    with pytest.raises(GraphError, match="bad.json.*not valid JSON"):
        Graph.from_file(bad)
    invalid = tmp_path / "invalid.json"
    d = small()
    node(d, "a")["op"] = "swish"
    invalid.write_text(json.dumps(d))
    with pytest.raises(GraphError, match=r"invalid\.json.*node 'a'"):
        Graph.from_file(invalid)


def test_validation_does_not_mutate_the_input():
    d = small()
    before = copy.deepcopy(d)
    Graph.from_dict(d)
    assert d == before


def test_lm_metadata():
    g = build_model("transformer_lm", vocab_size=13, seq_len=7, d_model=8, n_heads=2, n_layers=1, d_ff=16)
    assert g.num_classes == 13 and g.predictions_per_sample == 7
    assert g.input("x").dtype == "int64" and g.input("x").shape == (None, 7)
    r = build_model("mlp", input_shape=(3,), num_classes=2, hidden=[], loss="mse")
    assert r.num_classes is None and r.metric_names == [] and r.predictions_per_sample == 1


def test_readme_documents_every_op_and_its_example_loads():
    import pathlib
    import re

    from hpc_rlx.graph import OPS

    text = (pathlib.Path(__file__).resolve().parents[3] / "hpc_rlx" / "graph" / "README.md").read_text()
    table = {m for row in re.findall(r"^\| (.+?) \|", text, re.M) for m in re.findall(r"`(\w+)`", row)}
    assert set(OPS) <= table, sorted(set(OPS) - table)
    example = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    g = Graph.from_json(example)
    assert g.num_classes == 10 and g.metric_names == ["correct"]
