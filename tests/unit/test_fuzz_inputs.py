"""Property-based fuzzing of what users hand in: graph JSON, and configs on their way to a spec.

Whatever the input, it loads or it raises the documented error type (an HpcRlxError subclass)
with a message: never another exception, and never a hang (hypothesis deadlines).
"""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hpc_rlx.base.errors import GraphError, HpcRlxError
from hpc_rlx.graph import Graph, build_model

FAST = settings(max_examples=300, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

# JSON values, nested a little
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                    st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=6))
json_values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                           max_leaves=12)
# config values also meet NaN/Inf and odd types
config_values = st.one_of(scalars, st.floats(allow_nan=True, allow_infinity=True),
                          st.lists(st.integers(-5, 300), max_size=3),
                          st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2))


def _graphs() -> list[dict]:
    return [
        build_model("mlp", input_shape=(6,), num_classes=3, hidden=[4]).to_dict(),
        build_model("cnn", input_shape=(1, 8, 8), num_classes=3, channels=[2], kernel=3, hidden=4,
                    pool="max").to_dict(),
    ]


GRAPHS = _graphs()


def _loads_or_graph_error(fn, *args) -> Graph | None:
    try:
        g = fn(*args)
    except GraphError as e:
        assert str(e).strip(), "GraphError without a message"
        return None
    assert isinstance(g, Graph)
    return g


def _paths(obj, prefix=()):
    """Every (path, value) in a nested dict/list structure."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _delete(obj, path):
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]


# --------------------------------------------------------------------------------------
# Graph JSON
# --------------------------------------------------------------------------------------

@FAST
@given(json_values)
def test_graph_from_any_json_value(value):
    _loads_or_graph_error(Graph.from_dict, value)


@FAST
@given(st.text(max_size=200))
def test_graph_from_any_text(text):
    _loads_or_graph_error(Graph.from_json, text)


@FAST
@given(st.sampled_from(range(len(GRAPHS))), st.data())
def test_graph_with_one_part_replaced_deleted_or_added(which, data):
    g = copy.deepcopy(GRAPHS[which])
    paths = [p for p, _ in _paths(g) if p]
    path = data.draw(st.sampled_from(paths), label="path")
    action = data.draw(st.sampled_from(["replace", "delete", "add", "swap"]), label="action")
    if action == "replace":
        _set(g, path, data.draw(json_values, label="value"))
    elif action == "delete":
        _delete(g, path)
    elif action == "add":
        target = g
        for key in path[:-1]:
            target = target[key]
        if isinstance(target, dict):
            target[data.draw(st.text(max_size=6), label="key")] = data.draw(json_values, label="value")
        else:
            target.insert(path[-1], data.draw(json_values, label="value"))
    else:   # another value of the same graph in this place: plausible-looking but wrong
        other = data.draw(st.sampled_from([v for _, v in _paths(g)]), label="other")
        _set(g, path, copy.deepcopy(other))
    loaded = _loads_or_graph_error(Graph.from_dict, g)
    if loaded is not None:
        # whatever loads survives its own JSON form unchanged
        again = Graph.from_json(loaded.to_json())
        assert again.fingerprint() == loaded.fingerprint()


@FAST
@given(st.sampled_from(range(len(GRAPHS))), st.data())
def test_graph_json_text_with_bytes_cut_or_inserted(which, data):
    text = json.dumps(GRAPHS[which])
    i = data.draw(st.integers(0, len(text)), label="at")
    n = data.draw(st.integers(0, 8), label="cut")
    ins = data.draw(st.text(alphabet='{}[]",:0123456789.-enulltrue ', max_size=6), label="insert")
    _loads_or_graph_error(Graph.from_json, text[:i] + ins + text[i + n:])


def test_graph_file_errors_are_graph_errors(tmp_path):
    with pytest.raises(GraphError, match="cannot be read"):
        Graph.from_file(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(GraphError, match="bin.json"):
        Graph.from_file(tmp_path / "bin.json")


# --------------------------------------------------------------------------------------
# Config -> spec
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_config(tmp_path_factory):
    """The composed default config as plain data, pointed at a small dataset file."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.support.jobs import REPO, write_small_classification

    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "fuzz")
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["data=file", "data.path=PLACEHOLDER", "model.hidden=[4]",
                                           "train.batch_size=8"])
    container = OmegaConf.to_container(cfg, resolve=True)
    path = write_small_classification(tmp_path_factory.mktemp("fuzz") / "small.h5", rows=40, seed=0)
    container["data"]["path"] = str(path)
    return container


def _leaves(cfg: dict, sections) -> list[tuple]:
    """Paths of every non-dict value (lists and their items too) under the given sections."""
    return [p for p, v in _paths({k: cfg[k] for k in sections}) if len(p) > 1 and not isinstance(v, dict)]


VALIDATED = ("train", "optim", "comm", "device", "checkpoint", "data", "policy", "debug")


def _check_raises_documented(fn, *args):
    try:
        out = fn(*args)
    except HpcRlxError as e:
        assert str(e).strip(), f"{type(e).__name__} without a message"
        event(f"raised {type(e).__name__}")
        return None
    event("accepted")
    return out


@FAST
@given(st.data())
def test_validate_config_on_mutated_configs(base_config, data):
    from hpc_rlx.config.spec import validate_config

    cfg = copy.deepcopy(base_config)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(_leaves(cfg, VALIDATED)), label="path")
        _set(cfg, path, data.draw(config_values, label="value"))
    _check_raises_documented(validate_config, cfg)


# per key: values that are often fine, mixed with anything at all
PLAUSIBLE = {
    ("model", "hidden"): st.lists(st.integers(-2, 12), max_size=3),
    ("model", "activation"): st.sampled_from(["relu", "gelu", "tanh", "sigmoid", "swish"]),
    ("model", "dropout"): st.floats(-0.5, 1.5),
    ("model", "num_classes"): st.one_of(st.none(), st.integers(-1, 5)),
    ("data", "x"): st.sampled_from(["x", "y", "inputs", ""]),
    ("data", "y"): st.sampled_from(["y", "x", "labels"]),
    ("data", "val_fraction"): st.one_of(st.none(), st.floats(-0.2, 1.2)),
    ("data", "leftover"): st.sampled_from(["drop", "partial", "keep"]),
    ("train", "batch_size"): st.integers(-2, 50),
    ("train", "epochs"): st.integers(-1, 3),
    ("optim", "lr"): st.floats(-1, 1),
    ("device", "cpu_lanes"): st.integers(-1, 4),
    ("device", "kind"): st.sampled_from(["cpu", "cuda", "all", "auto", "tpu"]),
}
MODEL_DATA_KEYS = sorted(PLAUSIBLE)


@settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_build_spec_on_mutated_configs(base_config, tmp_path, data):
    from hpc_rlx.config.spec import TrainSpec, build_spec

    cfg = copy.deepcopy(base_config)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        path = data.draw(st.sampled_from(MODEL_DATA_KEYS), label="path")
        _set(cfg, path, data.draw(st.one_of(PLAUSIBLE[path], config_values), label="value"))
    world = data.draw(st.integers(1, 12), label="world_size")
    spec = _check_raises_documented(build_spec, cfg, str(tmp_path / "run"), world)
    if spec is not None:
        # a spec that builds is complete: it survives its JSON form and rebuilds its graph
        again = TrainSpec.from_dict(json.loads(spec.to_json()))
        assert Graph.from_dict(again.graph).fingerprint() == Graph.from_dict(spec.graph).fingerprint()
        assert again.world_size == world
