"""A later segment's record of changed settings (config/segments.py)."""

import yaml

from hpc_rlx.config.segments import start_segment


def _config(**sections) -> str:
    base = {"train": {"epochs": 2, "batch_size": 32}, "optim": {"name": "sgd", "lr": 0.1},
            "comm": {}}
    for name, keys in sections.items():
        base[name] = {**base.get(name, {}), **keys}
    return yaml.safe_dump(base)


def test_keys_an_older_config_lacks_are_no_change_at_their_defaults(tmp_path):
    old = _config()
    assert start_segment(tmp_path, old, resumed_from=None, resumed_config_yaml=None,
                         start_step=0, start_epoch=0, world_size=1) is None
    # the new config spells out defaults the old one never named, and changes two settings
    new = _config(train={"epochs": 4, "accumulate": 1}, optim={"lr": 0.05},
                  comm={"shard": "none", "node_shared_params": False, "reduction": "auto"})
    record = start_segment(tmp_path, new, resumed_from="ckpt.h5", resumed_config_yaml=old,
                           start_step=10, start_epoch=1, world_size=2)
    assert record["changed"] == {"optim.lr": [0.1, 0.05], "train.epochs": [2, 4]}
    assert record["segment"] == 2 and (tmp_path / "config.segment-2.yaml").read_text() == new


def test_a_key_set_away_from_its_default_is_a_change(tmp_path):
    old = _config()
    start_segment(tmp_path, old, resumed_from=None, resumed_config_yaml=None, start_step=0,
                  start_epoch=0, world_size=1)
    record = start_segment(tmp_path, _config(train={"accumulate": 4}), resumed_from=None,
                           resumed_config_yaml=None, start_step=0, start_epoch=0, world_size=1)
    assert record["changed"] == {"train.accumulate": [1, 4]}
