"""The config schema (`hpc_rlx.config.schema`) against the YAML groups: every key is declared
once, with the default its YAML file gives it; every option of every config group composes and
validates. docs/config.md's generated table: tests/docs/test_config_reference.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpc_rlx.config import schema as schema
from hpc_rlx.__main__ import _CONFIG_DIR
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.policies.registry import POLICIES
from hpc_rlx.config.spec import validate_config


CONFIGS = Path(_CONFIG_DIR)
FIXED = ("train", "comm", "parallel", "report", "trace", "debug")
# config groups that are not sections: overlays of other sections, and Hydra's own
OVERLAYS = ("experiment",)


def _yaml(path: Path) -> dict:
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    data.pop("defaults", None)
    return data


def _group_dirs() -> list[str]:
    return sorted(p.name for p in CONFIGS.iterdir() if p.is_dir() and p.name != "hydra")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _same(a, b) -> bool:
    """Equal and of one type: `10` and `10.0` are different defaults, `true` and `1` too."""
    return type(a) is type(b) and a == b


def test_config_yaml_sections_match_the_schema():
    top = _yaml(CONFIGS / "config.yaml")
    top.pop("hydra")
    for section in FIXED:
        declared = schema.defaults(section)
        assert list(top[section]) == list(declared), section
        for name, value in top[section].items():
            assert _same(value, declared[name]), (f"{section}.{name}", value, declared[name])
    for path in schema.TOP_LEVEL:
        assert _same(top[path], schema.BY_PATH[path].default), path
    assert set(top) == set(FIXED) | set(schema.TOP_LEVEL), sorted(top)


@pytest.mark.parametrize("group", [g for g in _group_dirs() if g not in OVERLAYS])
def test_every_group_option_matches_the_schema(group):
    assert tuple(sorted(schema.GROUPS[group][1])) == tuple(_options(group)), group
    for option in _options(group):
        values = _yaml(CONFIGS / group / f"{option}.yaml")
        declared = schema.defaults(group, option)
        assert set(values) == set(declared), (f"{group}={option}", sorted(values), sorted(declared))
        for name, value in values.items():
            assert _same(value, declared[name]), (f"{group}={option}: {group}.{name}", value, declared[name])


def test_every_group_of_the_config_dir_is_known():
    assert set(_group_dirs()) == set(schema.GROUPS) | set(OVERLAYS)
    assert set(schema.GROUPS["policy"][1]) == set(POLICIES)
    # the options config.yaml selects are the ones the schema completes with
    chosen = [d for d in OmegaConf.load(CONFIGS / "config.yaml").defaults if isinstance(d, dict)]
    for entry in chosen:
        (group, option), = entry.items()
        if group in schema.GROUPS:
            assert schema.GROUPS[group][2] == option, group


def test_overlay_keys_are_declared():
    for option in _options("experiment"):
        values = _yaml(CONFIGS / "experiment" / f"{option}.yaml")
        for section, keys in values.items():
            for name in keys:
                assert f"{section}.{name}" in schema.BY_PATH, f"experiment={option}: {section}.{name}"


def test_declared_defaults_have_their_types():
    for key in schema.KEYS:
        values = key.default.values() if isinstance(key.default, schema.Options) else [key.default]
        for value in values:
            assert value is None or value == "???" or isinstance(value, key.type), (key.path, value)
            if value is not None and value != "???" and key.check is not None:
                key.validate(value, 4)            # a default passes its own check


def _compose(overrides: list[str]) -> dict:
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "schema")
    with initialize_config_dir(config_dir=_CONFIG_DIR, version_base="1.3", job_name="schema"):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


ALL_OPTIONS = [(g, o) for g in _group_dirs() for o in _options(g)]


@pytest.mark.parametrize("group,option", ALL_OPTIONS, ids=[f"{g}={o}" for g, o in ALL_OPTIONS])
def test_every_option_of_every_group_composes_and_validates(group, option):
    overrides = [f"{group}={option}"]
    # keys the YAML leaves for the user to set (`???`): a value as a user would give it
    if (group, option) == ("model", "graph"):
        overrides.append("model.path=g.json")
    if (group, option) == ("data", "file"):
        overrides.append("data.path=d.h5")
    cfg = _compose(overrides)
    completed = validate_config(cfg, world_size=2)
    if group in schema.GROUPS and group != "policy":
        assert completed[group] == cfg[group]         # composed configs are complete already
    for section in schema.SECTIONS:
        option = schema.option_of(section, cfg[section]) if section in schema.GROUPS else None
        keys = list(schema.keys_of(section, option))
        # a nested key (model.lora.rank) sits in a mapping under its head (model.lora)
        assert set(completed[section]) == {k.name.partition(".")[0] for k in keys}, section
        for k in keys:
            assert schema.value_of(completed[section], k.name) is not schema.ABSENT, k.path


def test_validation_fails_on_a_bad_value_of_each_checked_key():
    cfg = _compose([])
    checked = []
    for key in schema.KEYS:
        if key.check is None or key.section not in cfg or schema.value_of(cfg[key.section], key.name) is schema.ABSENT:
            continue
        head, _, leaf = key.name.partition(".")
        section = dict(cfg[key.section])
        section[head] = dict(section[head], **{leaf: [object()]}) if leaf else [object()]   # model.lora.rank
        with pytest.raises(ConfigError, match=re.escape(key.label or key.path)):
            validate_config(dict(cfg, **{key.section: section}), world_size=2)
        checked.append(key.path)
    assert {"model.lora.rank", "model.lora.alpha", "model.lora.dropout", "model.lora.targets"} <= set(checked)


def test_a_nested_section_takes_a_mapping_of_its_declared_keys_only():
    cfg = _compose([])
    assert validate_config(dict(cfg, model=dict(cfg["model"], lora={"rank": 2})))["model"]["lora"] == {
        "rank": 2, "alpha": 8, "dropout": 0.0, "targets": []}          # completed key by key
    with pytest.raises(ConfigError, match=r"model.lora does not take \['rnk'\]; its keys: "
                                          r"\['alpha', 'dropout', 'rank', 'targets'\]"):
        validate_config(dict(cfg, model=dict(cfg["model"], lora={"rnk": 2})))
    with pytest.raises(ConfigError, match=r"model.lora must be a mapping of"):
        validate_config(dict(cfg, model=dict(cfg["model"], lora=4)))
    with pytest.raises(ConfigError, match=r"model.lora.dropout must be a probability in \[0, 1\)"):
        validate_config(dict(cfg, model=dict(cfg["model"], lora={"rank": 2, "dropout": 1.0})))


def test_a_hand_made_config_is_completed_with_the_declared_defaults():
    cfg = _compose([])
    for section in ("train", "comm", "debug", "trace", "report"):
        cfg[section] = {}
    del cfg["optim"]["min_lr"]
    done = validate_config(cfg)
    assert done["train"] == schema.defaults("train") and done["comm"]["stall_abort_s"] == "auto"
    assert done["optim"]["min_lr"] == schema.defaults("optim", "sgd")["min_lr"]


def test_a_group_section_renamed_to_another_option_is_refused():
    with pytest.raises(ConfigError, match=r"optim.name='adamw' does not take \['momentum', 'nesterov'\]"):
        validate_config(_compose(["optim.name=adamw"]))


def test_bool_keys_take_only_true_or_false():
    """`report.plots=no` is the string 'no', which Python reads as true: refused, for every
    bool key, with the message that names the key."""
    from hpc_rlx.config.schema import KEYS
    bools = [k for k in KEYS if k.type is bool]
    assert {"report.plots", "trace.enabled", "data.shuffle", "comm.deterministic"} <= {k.path for k in bools}
    for key in bools:
        for option in key.options() or [None]:
            key.validate(key.default_for(option))
            key.validate(not key.default_for(option))
        for bad in ("no", "yes", "false", 0, 2, None):
            with pytest.raises(ConfigError, match=rf"^{key.label or key.path} must be true or false, got "):
                key.validate(bad)


def test_integer_keys_are_bounded_at_2_63_minus_1():
    """A Python int past 64 bits passed every range check, then crashed the run at step 0 (in
    TensorBoard's hyper-parameter log): every key refuses it, with the bound in the message."""
    from hpc_rlx.base.checks import INT64_MAX
    from hpc_rlx.config.schema import KEYS
    too_large = INT64_MAX + 1
    for key in KEYS:
        if key.type is str:
            continue
        with pytest.raises(ConfigError, match=rf"^{re.escape(key.label or key.path)} must be at most "
                                              rf"2\*\*63 - 1 \({INT64_MAX}\), got {too_large}$"):
            key.validate(too_large)
    for override in ("train.seed", "train.max_steps", "policy.anchor"):
        overrides = [f"{override}=99999999999999999999"] + (["policy=cadence"] if "policy" in override else [])
        with pytest.raises(ConfigError, match=rf"^{override} must be at most 2\*\*63 - 1 .*, got 99999999999999999999$"):
            validate_config(_compose(overrides))
    # the bound itself is a value
    validate_config(_compose([f"train.seed={INT64_MAX}", f"train.max_steps={INT64_MAX}"]))


def test_unset_values_name_the_key_and_the_group_option():
    from omegaconf import OmegaConf

    from hpc_rlx.config.overrides import unset_values
    cfg = OmegaConf.create({"data": {"name": "file", "path": "???"}, "model": {"name": "mlp"},
                            "hydra": {"job": {"num": "???"}}})
    assert unset_values(cfg) == ("data=file needs data.path=<value> (the training data: an HDF5 file, "
                                 "a directory of them or a glob pattern): set it on the command line")
    cfg.data.path = "mine.h5"
    assert unset_values(cfg) is None


@pytest.mark.parametrize("section, override, message", [
    ("model", {"dropout": 1.5}, "model.dropout must be in [0, 1), got 1.5"),
    ("model", {"hidden": [128, "abc"]}, "model.hidden must be a positive int, got 'abc'"),
    ("model", {"activation": "Relu"}, "model.activation must be one of ['relu', 'gelu', 'tanh', 'sigmoid'], got 'Relu'"),
    ("optim", {"momentum": 2}, "optim.momentum must be a number in [0, 1), got 2"),
    ("optim", {"schedule": "linear"}, "optim.schedule='linear' is not one of ['constant', 'step', 'multistep', 'cosine']"),
    ("optim", {"schedule": "step", "gamma": 5}, "optim.gamma must be a number in (0, 1], got 5"),
    ("optim", {"betas": [1, 2]}, "optim.betas[0] must be a number in [0, 1), got 1"),
    ("optim", {"schedule": "multistep"}, "optim.milestones must be a non-empty list of steps after the "
     "warm-up, got []"),
    ("optim", {"schedule": "multistep", "milestones": [40, 120]}, "optim.milestones[1] (120) is not before "
     "the schedule's end: 100 steps follow the warm-up (milestones count optimizer steps after it)"),
])
def test_builder_and_optimizer_errors_name_the_config_key(section, override, message):
    """The builders and optimizers name their own parameters (library API); from a config the
    message names the key to change."""
    from hpc_rlx.config.spec import check_optimizer, with_config_keys
    from hpc_rlx.graph import build_model
    if section == "model":
        kwargs = {"hidden": [8], **override}
        build = lambda: build_model("mlp", input_shape=(4,), num_classes=3, **kwargs)  # noqa: E731
        with pytest.raises(ConfigError) as e:
            with_config_keys("model", schema.BUILDER_KEYS["mlp"], build)
    else:
        opt = {**schema.defaults("optim", "adamw" if "betas" in override else "sgd"), **override}
        with pytest.raises(ConfigError) as e:
            check_optimizer(opt, "float32", 100)
    assert str(e.value) == message


@pytest.mark.parametrize("override, schedule_steps, message", [
    ({"nesterov": True, "momentum": 0}, 100, "optim.nesterov=true needs momentum > 0, got momentum=0"),
    ({"weight_decay": -1}, 100, "optim.weight_decay must be a finite number >= 0, got -1"),
    ({"schedule": "step", "step_size": 0}, 100, "optim.step_size must be an integer >= 1, got 0"),
    ({"warmup_steps": 500}, 100, "optim.warmup_steps (500) is more than total_steps (100)"),
    ({"schedule": "cosine", "warmup_steps": 100}, 100,
     "optim.warmup_steps (100) leaves no steps to anneal over (total_steps=100)"),
    ({"schedule": "cosine", "min_lr": 5}, 100, "optim.min_lr (5.0) is above base_lr (0.1)"),
    # parameters no optim key sets keep the schedule's own name for them
    ({"lr": -1}, 100, "lr schedule 'cosine': base_lr must be a finite number >= 0, got -1.0"),
    ({}, 0, "lr schedule 'cosine': total_steps must be >= 1, got 0"),
])
def test_optimizer_and_schedule_errors_name_the_config_key(override, schedule_steps, message):
    from hpc_rlx.config.spec import check_optimizer
    opt = {**schema.defaults("optim", "sgd"), **override}
    with pytest.raises(ConfigError) as e:
        check_optimizer(opt, "float32", schedule_steps)
    assert str(e.value) == message


def test_config_keys_come_from_the_error_not_its_text():
    """`with_config_keys` restates an error by the parameter it carries: a message that merely
    begins with a key's name is left alone, and so is a parameter that is not one of the keys."""
    from hpc_rlx.config.spec import with_config_keys

    def fail(err):
        raise err

    plain = ConfigError("dropout must be in [0, 1), got 1.5")
    with pytest.raises(ConfigError) as e:
        with_config_keys("model", ("dropout",), lambda: fail(plain))
    assert e.value is plain
    other = ConfigError.bad_param("input_shape", " must have 3 dims, got (8, 8)")
    with pytest.raises(ConfigError) as e:
        with_config_keys("model", ("dropout",), lambda: fail(other))
    assert e.value is other
    with pytest.raises(ConfigError) as e:
        with_config_keys("optim", ("momentum",), lambda: fail(
            ConfigError.bad_param("momentum", " must be a number in [0, 1), got 2", "sgd")))
    assert str(e.value) == "optim.momentum must be a number in [0, 1), got 2"
    assert with_config_keys("model", ("dropout",), lambda: 7) == 7
