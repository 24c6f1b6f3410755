"""TrainSpec sections: read-only mappings of the keys their declaration has (config/section.py)."""

from __future__ import annotations

import json

import pytest

from hpc_rlx.config import schema
from hpc_rlx.config.section import SECTIONS, Section, UndeclaredKey
from hpc_rlx.config.spec import DataPlan, TrainSpec


def test_a_declared_key_reads_and_a_typo_fails_at_the_first_read():
    train = Section("train", schema.defaults("train"))
    assert train["epochs"] == 20 and train.get("max_steps", 5) is None
    for read in (lambda: train["epoch"], lambda: train.get("epoch", 1), lambda: "epoch" in train):
        with pytest.raises(UndeclaredKey, match=r"train\.epoch is not a declared config key"):
            read()


def test_a_key_of_another_group_option_reads_as_absent():
    optim = Section("optim", schema.defaults("optim", "adamw"))
    assert optim.get("momentum", 0.0) == 0.0 and "momentum" not in optim
    with pytest.raises(KeyError):
        optim["momentum"]
    with pytest.raises(UndeclaredKey):
        optim.get("momentun")


def test_policy_keys_are_the_selected_policys():
    cadence = Section("policy", schema.defaults("policy", "cadence"))
    assert cadence["max_batch_diff"] is None and cadence["anchor"] == 10
    with pytest.raises(UndeclaredKey, match="policy.tune"):      # async's key, not cadence's
        cadence["tune"]
    with pytest.raises(UndeclaredKey, match="not declared"):
        Section("policy", {"name": "sync", "anchor": 3})


def test_a_section_refuses_an_undeclared_key_and_any_write():
    with pytest.raises(UndeclaredKey, match=r"comm: \['overlapp'\] not declared"):
        Section("comm", {**schema.defaults("comm"), "overlapp": True})
    comm = Section("comm", schema.defaults("comm"))
    with pytest.raises(TypeError):
        comm["overlap"] = True          # noqa: the point of the test


def test_every_section_of_the_spec_is_declared_by_the_schema_or_the_policy():
    for name in SECTIONS:
        values = schema.defaults(name)
        assert dict(Section(name, values)) == values, name


def _spec() -> TrainSpec:
    data = DataPlan(path="d.h5", x="x", y="y", n_train=8, val_path=None, val_start=8, val_stop=10,
                    distribution="read", leftover="drop", shuffle=True, check_finite=False,
                    sample_shape=[4], x_dtype="float32", y_dtype="int64")
    sections = {name: schema.defaults(name) for name in SECTIONS}
    return TrainSpec(graph={}, param_source={"kind": "seed", "seed": 0}, data=data, run_dir="run",
                     resume="auto", world_size=2, **sections)


def test_the_json_form_is_the_plain_dicts_and_round_trips():
    spec = _spec()
    assert all(isinstance(getattr(spec, name), Section) for name in SECTIONS)
    d = spec.to_dict()
    assert all(type(d[name]) is dict and d[name] == schema.defaults(name) for name in SECTIONS)
    again = TrainSpec.from_dict(json.loads(spec.to_json()))
    assert again.to_json() == spec.to_json()
    assert again.optim["lr"] == 0.1 and isinstance(again.policy, Section)


def test_every_schema_section_the_spec_carries_as_a_field_is_typed():
    """A new config section that becomes a TrainSpec field (as `parallel` did) is listed in
    `config.section.SECTIONS`, so it refuses undeclared keys like the others."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainSpec)}
    carried = {s for s in schema.SECTIONS if s in fields} - {"data"}     # data: the DataPlan
    assert carried | {"policy"} == set(SECTIONS)
