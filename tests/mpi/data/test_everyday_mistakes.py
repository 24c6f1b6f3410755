"""First-use data and config mistakes: a mistyped data.path, keys in the wrong section, datasets
with other names, no num_classes anywhere, and regression runs (no accuracy to report).

Real `mpirun` jobs on real HDF5 files."""

from __future__ import annotations

import json
import re
import subprocess

import h5py
import numpy as np
import pytest

from tests.support.jobs import PYTHON, REPO, explain, mpi_env, mpirun, read_metrics, train_job

pytestmark = pytest.mark.mpi

SMALL = ["train.epochs=1", "train.batch_size=8", "model.hidden=[8]", "checkpoint=off"]


def _error_lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc_rlx: error")]


def _write(path, x, y, attrs=None, x_name="x", y_name="y", y_attrs=None):
    with h5py.File(path, "w") as f:
        f[x_name] = x
        f[y_name] = y
        for k, v in (attrs or {}).items():
            f.attrs[k] = v
        for k, v in (y_attrs or {}).items():
            f[y_name].attrs[k] = v
    return path


def _classification(rows=96, features=6, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    y = (np.arange(rows) % classes).astype(np.int64)
    x = rng.standard_normal((rows, features)).astype(np.float32) + y[:, None]
    return x, y


# ---- item 1: a mistyped data.path with the default data group ----------------------------

def test_missing_data_path_with_the_default_group_is_an_error(tmp_path):
    """`data.path=<missing>` without data=file used to write digits there and train on them;
    the group's own path (data/digits.h5, relative to where the job starts) is still prepared."""
    missing = tmp_path / "some" / "missing" / "file.h5"
    run = tmp_path / "run"
    proc = train_job(2, run, [f"data.path={missing}"] + SMALL, timeout=90)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1, explain(proc)
    assert str(missing) in errors[0] and "does not exist" in errors[0], explain(proc)
    assert "data=file" in errors[0], explain(proc)
    assert not missing.exists() and not missing.parent.exists(), "a dataset was written at the mistyped path"
    assert not (run / "metrics.jsonl").exists()
    assert "Traceback" not in proc.stderr

    proc = mpirun(2, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run2'}", "report.plots=false",
                      "train.max_steps=2"] + SMALL, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, explain(proc)
    with h5py.File(tmp_path / "data" / "digits.h5", "r") as f:
        assert f["x"].shape == (1797, 1, 8, 8)


def test_prepare_decision_is_by_the_groups_own_path(tmp_path, monkeypatch):
    from hpc_rlx.data.resolve import prepare_missing_data
    from hpc_rlx.base.errors import DataError

    monkeypatch.chdir(tmp_path)
    d = {"name": "synthetic", "path": "data/synthetic.h5", "prepare": "synthetic"}
    prepare_missing_data(d)
    assert (tmp_path / "data" / "synthetic.h5").is_file()
    # the same default, spelled as an absolute path, is the same file
    d2 = dict(d, path=str(tmp_path / "data" / "digits.h5"), name="digits", prepare="digits")
    prepare_missing_data(d2)
    assert (tmp_path / "data" / "digits.h5").is_file()
    for name in ("digits", "synthetic", "text"):
        with pytest.raises(DataError, match=r"'other/x\.h5' does not exist.*data=file data\.path=other/x\.h5"):
            prepare_missing_data({"name": name, "path": "other/x.h5", "prepare": name})
    assert not (tmp_path / "other").exists()


# ---- item 11: keys in the wrong section, datasets with other names -----------------------

def test_key_in_the_wrong_section_suggests_where_it_lives(tmp_path):
    for override, suggestion in (("train.lr=0.01", "optim.lr"), ("lr=0.01", "optim.lr"),
                                 ("optim.epochs=3", "train.epochs"),
                                 ("train.val_fraction=0.1", "data.val_fraction")):
        proc = mpirun(1, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", override], timeout=60)
        assert proc.returncode == 2, explain(proc)
        errors = _error_lines(proc)
        assert len(errors) == 1, explain(proc)
        assert f"did you mean '{suggestion}'?" in errors[0], explain(proc)


def test_key_of_another_group_option_names_the_option(tmp_path):
    """optim.betas exists only with optim=adamw, lamb and lion: say so instead of guessing a near name."""
    proc = mpirun(1, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", "train.betas=[0.9,0.99]"],
                  timeout=60)
    assert proc.returncode == 2, explain(proc)
    assert "'optim.betas' (with optim=adamw or optim=lamb or optim=lion)" in proc.stderr, explain(proc)


def test_a_right_key_for_an_option_not_selected_names_both_options(tmp_path):
    """model.num_classes with model=onnx: the key is right, the option lacks it; no suggestion
    that repeats the key."""
    proc = mpirun(1, ["-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", "model=onnx",
                      "model.num_classes=128"], timeout=60)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1 and "did you mean" not in errors[0], explain(proc)
    assert ("config key 'model.num_classes' (from 'model.num_classes=128') is not read with model=onnx, "
            "only with model=cnn or model=mlp or model=transformer_lm") in errors[0], explain(proc)


def test_other_dataset_names_get_one_message_with_both_overrides(tmp_path):
    x, y = _classification()
    path = _write(tmp_path / "mine.h5", x, y, attrs={"num_classes": 5}, x_name="data", y_name="label")
    proc = train_job(2, tmp_path / "run", ["data=file", f"data.path={path}"] + SMALL, timeout=90)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1, explain(proc)
    assert "data.x=data data.y=label" in errors[0], explain(proc)
    # and following the advice trains
    proc = train_job(2, tmp_path / "run2", ["data=file", f"data.path={path}", "data.x=data",
                                            "data.y=label"] + SMALL, timeout=90)
    assert proc.returncode == 0, explain(proc)


def test_dataset_name_guess():
    from hpc_rlx.data.hdf5 import guess_dataset_names

    assert guess_dataset_names({"data": (100, 6), "label": (100,)}) == ("data", "label")
    assert guess_dataset_names({"targets": (10,), "features": (10, 3)}) == ("features", "targets")
    assert guess_dataset_names({"X_train": (10, 3), "y_train": (10,)}) == ("X_train", "y_train")
    # one per-sample array and one scalar-per-row array: the row vector is the label
    assert guess_dataset_names({"a": (10, 3), "b": (10,)}) == ("a", "b")
    # nothing to go on
    assert guess_dataset_names({"a": (10, 3), "b": (10, 3), "c": (10,)}) is None
    assert guess_dataset_names({"a": (10, 3)}) is None


# ---- item 12: the number of classes from the labels --------------------------------------

def test_num_classes_from_the_training_labels(tmp_path):
    x, y = _classification(classes=5)
    path = _write(tmp_path / "noattr.h5", x, y)
    run = tmp_path / "run"
    proc = train_job(2, run, ["data=file", f"data.path={path}"] + SMALL, timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert re.search(r"num_classes=5 from the training labels", proc.stdout), explain(proc)
    graph = json.loads((run / "graph.json").read_text())
    head = next(p for p in graph["params"] if p["name"] == "head.bias")
    assert head["shape"] == [5]


def test_num_classes_attribute_of_the_label_dataset(tmp_path):
    from hpc_rlx.config.spec import build_spec

    x, y = _classification(classes=5)
    cfg = _cfg(_write(tmp_path / "yattr.h5", x, y, y_attrs={"num_classes": 7}))
    spec = build_spec(cfg, str(tmp_path / "run"), 1)
    head = next(p for p in spec.graph["params"] if p["name"] == "head.bias")
    assert head["shape"] == [7]


def test_num_classes_attributes_that_disagree_are_an_error(tmp_path):
    from hpc_rlx.base.errors import DataError
    from hpc_rlx.config.spec import build_spec

    x, y = _classification(classes=5)
    cfg = _cfg(_write(tmp_path / "both.h5", x, y, attrs={"num_classes": 5}, y_attrs={"num_classes": 6}))
    with pytest.raises(DataError, match=r"num_classes=5 .* num_classes=6"):
        build_spec(cfg, str(tmp_path / "run"), 1)


def test_num_classes_inference_refuses_bad_labels(tmp_path):
    from hpc_rlx.base.errors import DataError
    from hpc_rlx.config.spec import build_spec

    x, y = _classification(classes=5)
    y = y.copy()
    y[3] = -1
    with pytest.raises(DataError, match=r"label -1 at row 3 .*negative"):
        build_spec(_cfg(_write(tmp_path / "neg.h5", x, y)), str(tmp_path / "run"), 1)
    with pytest.raises(DataError, match=r"float32, but the loss needs integer class indices"):
        build_spec(_cfg(_write(tmp_path / "flt.h5", x, y.astype(np.float32))), str(tmp_path / "run"), 1)


def _cfg(path) -> dict:
    """The composed default config with data=file on `path` (as rank 0 sees it)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from hpc_rlx.__main__ import _CONFIG_DIR

    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "test")
    with initialize_config_dir(config_dir=_CONFIG_DIR, version_base="1.3", job_name="t"):
        cfg = compose("config", overrides=["data=file", f"data.path={path}", "model.hidden=[8]",
                                           "train.batch_size=8"])
    return OmegaConf.to_container(cfg, resolve=True)


# ---- item 14: regression runs report no accuracy -----------------------------------------

def test_regression_run_reports_no_accuracy(tmp_path):
    from hpc_rlx.graph import build_model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 6)).astype(np.float32)
    y = np.stack([x[:, 0] - x[:, 1], 0.5 * x[:, 2]], axis=1).astype(np.float32)
    data = _write(tmp_path / "reg.h5", x, y)
    graph = tmp_path / "reg.json"
    build_model("mlp", input_shape=(6,), num_classes=2, hidden=[8], loss="mse").to_file(graph)
    run = tmp_path / "run"
    proc = mpirun(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", "data=file", f"data.path={data}",
                      "model=graph", f"model.path={graph}", "train.epochs=2", "train.batch_size=8",
                      "checkpoint=off", "train.progress=lines"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    recs = read_metrics(run)
    assert len(recs) == 2
    for rec in recs:
        assert "val_accuracy" not in rec and "train_accuracy" not in rec, rec
        assert isinstance(rec["val_loss"], float)
    final = json.loads((run / "summary.json").read_text())["final"]
    assert "val_accuracy" not in final and isinstance(final["val_loss"], float), final
    assert "val_loss" in proc.stdout and "val_acc" not in proc.stdout and "val_accuracy" not in proc.stdout, explain(proc)
    # the report: no accuracy line in the text, no accuracy panel in the plots
    rep = subprocess.run([PYTHON, "-m", "hpc_rlx.report", str(run)], cwd=REPO, env=mpi_env(),
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "val_loss" in rep.stdout and "accuracy" not in rep.stdout, rep.stdout
    from hpc_rlx.observe.run_files import load_run
    from hpc_rlx.observe.plots import curve_panels
    panels = curve_panels(load_run(run).metrics)
    assert "loss" in panels and "accuracy" not in panels, panels


def test_regression_cannot_checkpoint_by_accuracy(tmp_path):
    from hpc_rlx.graph import build_model

    rng = np.random.default_rng(1)
    x = rng.standard_normal((96, 6)).astype(np.float32)
    data = _write(tmp_path / "reg.h5", x, x[:, :2].copy())
    graph = tmp_path / "reg.json"
    build_model("mlp", input_shape=(6,), num_classes=2, hidden=[8], loss="mse").to_file(graph)
    proc = train_job(2, tmp_path / "run", ["data=file", f"data.path={data}", "model=graph",
                                           f"model.path={graph}", "train.epochs=1",
                                           "train.batch_size=8", "checkpoint.metric=val_accuracy"],
                     timeout=90)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1 and "checkpoint.metric=val_accuracy" in errors[0], explain(proc)


def test_sweep_summary_of_regression_points_has_no_accuracy_column(tmp_path):
    from hpc_rlx.observe.sweep import collect, render

    for i, final in enumerate(({"val_loss": 0.5, "train_loss": 0.4}, {"val_loss": 0.25, "train_loss": 0.2})):
        point = tmp_path / str(i)
        point.mkdir()
        (point / "overrides.txt").write_text(f"optim.lr=0.{i + 1}\n")
        (point / "summary.json").write_text(json.dumps({"final": final, "status": "completed",
                                                        "epochs_completed": 2}))
    rows = collect(tmp_path)
    assert all("val_accuracy" not in r for r in rows)
    table = render(rows)
    assert "val_accuracy" not in table and "0.2500" in table
    # a classification sweep keeps the column
    assert "val_accuracy" in render([dict(rows[0], val_accuracy=0.9)])


def test_key_suggestions_search_the_whole_tree_then_other_options():
    from hpc_rlx.__main__ import _CONFIG_DIR
    from hpc_rlx.config.hints import group_option_keys, suggest_keys

    other = group_option_keys(_CONFIG_DIR)
    known = ["train", "train.epochs", "optim", "optim.lr", "optim.momentum", "model", "model.hidden"]
    assert suggest_keys("train.lr", known, other) == ["'optim.lr'"]
    assert suggest_keys("train.betas", known, other) == ["'optim.betas' (with optim=adamw or optim=lamb or optim=lion)"]
    assert suggest_keys("train.epochz", known, other) == ["'train.epochs'"]
    assert suggest_keys("model.d_modl", known, other) == ["'model.d_model' (with model=transformer_lm)"]
    assert suggest_keys("zzz.qqq", known, other) == []


# ---- first-use audit: unset data.path, yes/no for booleans, NaN in the data -------------

def test_data_file_without_a_path_names_the_key(tmp_path):
    proc = mpirun(2, ["-m", "hpc_rlx", "data=file"], cwd=tmp_path, timeout=90)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1 and "data=file needs data.path=<value>" in errors[0], explain(proc)
    assert "???" not in proc.stderr, explain(proc)
    assert not (tmp_path / "outputs").exists()


def test_a_word_for_a_boolean_is_refused(tmp_path):
    proc = train_job(2, tmp_path / "run", ["report.plots=no", "data.shuffle=maybe"] + SMALL, timeout=90)
    assert proc.returncode == 2, explain(proc)
    errors = _error_lines(proc)
    assert len(errors) == 1 and "must be true or false, got '" in errors[0], explain(proc)
    assert not (tmp_path / "run").exists()


def _with_nan(tmp_path, name, row):
    x, y = _classification(rows=120)
    x[row, 2] = np.nan
    return _write(tmp_path / name, x, y, attrs={"num_classes": 5})


def test_nan_in_a_training_row_points_at_the_data(tmp_path):
    path = _with_nan(tmp_path, "nan.h5", 3)
    proc = train_job(2, tmp_path / "run", ["data=file", f"data.path={path}", "data.shuffle=false"] + SMALL,
                     timeout=90)
    assert proc.returncode == 2, explain(proc)
    (error,) = _error_lines(proc)
    assert "(NonFiniteError, reported by rank 0 on " in error, explain(proc)
    assert "non-finite loss or gradient" in error and "data.check_finite=true" in error, explain(proc)
    # following that advice names the row, and does not advise turning the check off again
    proc = train_job(2, tmp_path / "run2", ["data=file", f"data.path={path}", "data.check_finite=true"] + SMALL,
                     timeout=90)
    assert proc.returncode == 2, explain(proc)
    (error,) = _error_lines(proc)
    assert "input row 3 contains a non-finite value" in error and "check_finite=false" not in error, explain(proc)


def test_nan_in_a_validation_row_is_an_error_not_a_nan_metric(tmp_path):
    path = _with_nan(tmp_path, "nanval.h5", 117)      # in the 20 % validation tail
    proc = train_job(2, tmp_path / "run", ["data=file", f"data.path={path}"] + SMALL, timeout=90)
    assert proc.returncode == 2, explain(proc)
    (error,) = _error_lines(proc)
    assert "validation loss is nan at epoch 1 while the training loss is finite" in error, explain(proc)
    assert f"rows 96-119 of {path}" in error and "data.check_finite=true" in error, explain(proc)
    # train.on_nonfinite=skip: a warning, and the run goes on
    proc = train_job(2, tmp_path / "run2", ["data=file", f"data.path={path}", "train.on_nonfinite=skip"] + SMALL,
                     timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("warning: validation loss is nan") == 1, explain(proc)


def test_help_is_printed_once_with_a_usage_line(tmp_path):
    proc = mpirun(2, ["-m", "hpc_rlx", "--help"], cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, explain(proc)
    assert proc.stdout.count("Usage: mpirun -n N python -m hpc_rlx") == 1, explain(proc)
    assert "== Configuration groups ==" in proc.stdout and "is powered by Hydra" not in proc.stdout
    assert not (tmp_path / "outputs").exists()
