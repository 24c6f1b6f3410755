"""The config fingerprint and the run-directory rule for runs of one Slurm job (pure logic)."""

from __future__ import annotations

import copy

import pytest

from hpc_rlx.config.fingerprint import UNKNOWN, changed_settings, choose_job_dir, config_fingerprint, flatten, job_dir_number
from hpc_rlx.config.rundirs import compose_config


@pytest.fixture(scope="module")
def default_cfg() -> dict:
    return compose_config([])


def fp(cfg: dict, **changes) -> str:
    cfg = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config_fingerprint(cfg, cwd="/work")


@pytest.mark.parametrize("change", [
    {"optim__lr": 0.05}, {"optim__schedule": "constant"}, {"optim__momentum": 0.5}, {"optim__milestones": [5]},
    {"policy__name": "cadence"}, {"model__hidden": [64]}, {"model__activation": "tanh"},
    {"model__freeze": ["fc0.*"]}, {"model__train_only": ["head.*"]},
    {"model__lora": {"rank": 2, "alpha": 8, "dropout": 0.0, "targets": ["fc0"]}},
    {"data__path": "data/other.h5"}, {"data__val_fraction": 0.1}, {"data__leftover": "partial"},
    {"train__batch_size": 32}, {"train__seed": 1}, {"train__dtype": "float64"},
])
def test_what_is_trained_changes_the_fingerprint(default_cfg, change):
    assert fp(default_cfg, **change) != fp(default_cfg)


@pytest.mark.parametrize("change", [
    {"train__epochs": 40}, {"train__max_steps": 100}, {"train__threads_per_rank": 2},
    {"train__log_every_s": 1}, {"checkpoint__every_minutes": 1}, {"comm__bucket_cap_mb": 4},
    {"report__plots": False}, {"device__cpu_lanes": 2}, {"resume": "none"},
])
def test_a_longer_run_or_another_world_size_keeps_the_fingerprint(default_cfg, change):
    # the world size is not a config key at all: nothing of it can enter
    assert fp(default_cfg, **change) == fp(default_cfg)


def test_the_same_settings_spelled_differently_give_the_same_fingerprint(default_cfg):
    assert fp(default_cfg, optim__lr=1) == fp(default_cfg, optim__lr=1.0)
    cfg = copy.deepcopy(default_cfg)
    cfg["data"]["path"] = "/work/data/digits.h5"
    assert config_fingerprint(cfg, cwd="/elsewhere") == config_fingerprint(default_cfg, cwd="/work")
    assert config_fingerprint(default_cfg, cwd="/work") != config_fingerprint(default_cfg, cwd="/elsewhere")


def test_a_key_added_at_its_unset_default_keeps_older_fingerprints(default_cfg):
    """optim.milestones came after runs were fingerprinted: empty, it is left out."""
    older = copy.deepcopy(default_cfg)
    del older["optim"]["milestones"]
    assert default_cfg["optim"]["milestones"] == []
    assert config_fingerprint(older, cwd="/work") == fp(default_cfg)
    # model.freeze and model.train_only came later still: empty, they are left out too
    assert default_cfg["model"]["freeze"] == default_cfg["model"]["train_only"] == []
    del older["model"]["freeze"], older["model"]["train_only"]
    assert config_fingerprint(older, cwd="/work") == fp(default_cfg)


def test_the_fragment_schedule_at_its_default_keeps_older_fingerprints():
    """policy.fragment_schedule came after runs were fingerprinted: at round_robin, it is left
    out (a checkpoint of an async run from before it resumes in its own directory); another
    schedule trains otherwise."""
    cfg = compose_config(["policy=async"])
    assert cfg["policy"]["fragment_schedule"] == "round_robin"
    older = copy.deepcopy(cfg)
    del older["policy"]["fragment_schedule"]
    assert config_fingerprint(older, cwd="/work") == fp(cfg)
    assert fp(cfg, policy__fragment_schedule="reverse") != fp(cfg)


def test_a_graph_file_counts_by_content():
    cfg = {"model": {"name": "graph", "path": "g.json"}, "data": {}, "optim": {}, "policy": {}, "train": {}}
    assert config_fingerprint(cfg, graph_text="{}") != config_fingerprint(cfg, graph_text='{"a": 1}')
    assert config_fingerprint(cfg, graph_text="{}") == config_fingerprint(cfg, graph_text="{}")


def test_changed_settings_names_every_dotted_key_that_differs():
    old = {"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "train": {"epochs": 2}, "hydra": {"x": 1}}
    new = {"optim": {"lr": 0.05, "betas": [0.9, 0.99]}, "train": {"epochs": 4, "max_steps": 9},
           "hydra": {"x": 2}}
    assert changed_settings(old, new) == {"optim.lr": [0.1, 0.05], "train.epochs": [2, 4],
                                          "train.max_steps": [None, 9]}
    assert changed_settings(new, new) == {}
    assert flatten({"a": {"b": {}}, "c": 1}) == {"a.b": {}, "c": 1}


def test_job_directory_names():
    assert job_dir_number("slurm-12", "slurm-12") == 0
    assert job_dir_number("slurm-12.3", "slurm-12") == 3
    assert job_dir_number("slurm-123", "slurm-12") is None
    assert job_dir_number("slurm-12.x", "slurm-12") is None


BASE = "slurm-7"


@pytest.mark.parametrize("existing,mine,requeued,auto,expected", [
    ({}, "A", False, True, "slurm-7"),                                   # the job's first run
    ({"slurm-7": "A"}, "B", False, True, "slurm-7.1"),                   # another lr: fresh dir
    ({"slurm-7": "A"}, "A", False, True, "slurm-7"),                     # same training continues
    ({"slurm-7": "A", "slurm-7.1": "B"}, "A", False, True, "slurm-7"),   # back to the first config
    ({"slurm-7": "A", "slurm-7.1": "B"}, "C", False, True, "slurm-7.2"),
    ({"slurm-7": "A", "slurm-7.1": "A"}, "A", False, True, "slurm-7.1"),  # the newest match
    ({"slurm-7": "A"}, "A", False, False, "slurm-7.1"),                  # resume=none: never resume
    ({"slurm-7": UNKNOWN}, "A", False, True, "slurm-7.1"),               # nothing to prove it
    ({"slurm-7": UNKNOWN}, "A", True, True, "slurm-7"),                  # requeued job: its dir
    ({"slurm-7": "A", "slurm-7.1": UNKNOWN}, "B", True, True, "slurm-7.1"),
    ({"slurm-7": "A", "slurm-7.1": "B"}, "A", True, True, "slurm-7"),    # a requeued 2-run script
    ({"slurm-7.4": "A"}, "B", False, True, "slurm-7.5"),
])
def test_which_directory_a_run_of_the_job_uses(existing, mine, requeued, auto, expected):
    name, why = choose_job_dir(BASE, existing, mine, requeued, auto)
    assert name == expected, why
    assert why


def test_lora_off_keeps_older_fingerprints(default_cfg):
    """model.lora came after runs were fingerprinted: at rank 0 (off) it is left out."""
    older = copy.deepcopy(default_cfg)
    older["model"].pop("lora", None)
    off = copy.deepcopy(default_cfg)
    off["model"]["lora"] = {"rank": 0, "alpha": 16, "dropout": 0.1, "targets": ["x"]}
    assert config_fingerprint(off, cwd="/work") == config_fingerprint(older, cwd="/work")
