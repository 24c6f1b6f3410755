"""model.sync_batch_norm: the combinations it refuses, each in one line naming the key, and its
start-up line."""

from __future__ import annotations

import copy

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hpc_rlx.__main__ import _CONFIG_DIR
from hpc_rlx.config.batch_norm_sync import batch_norm_channels, check_sync_batch_norm, describe
from hpc_rlx.config.spec import validate_config
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.graph import GraphBuilder, build_model


@pytest.fixture(scope="module")
def base() -> dict:
    """A composed and validated model=onnx config (composed once: Hydra takes a second)."""
    if not OmegaConf.has_resolver("rlx_run_id"):
        OmegaConf.register_new_resolver("rlx_run_id", lambda: "sync_bn")
    with initialize_config_dir(config_dir=_CONFIG_DIR, version_base="1.3", job_name="sync_bn"):
        cfg = OmegaConf.to_container(compose("config", overrides=["model=onnx", "model.path=m.onnx", "device=cpu"]),
                                     resolve=True)
    return validate_config(cfg, world_size=2)


def _with(cfg: dict, **keys) -> dict:
    """``cfg`` with dotted keys set (``model__sync_batch_norm=True``)."""
    out = copy.deepcopy(cfg)
    for dotted, value in keys.items():
        section, name = dotted.split("__")
        out[section][name] = value
    return out


def test_off_by_default_and_on_with_sync_on_cpu(base):
    assert check_sync_batch_norm(base, 2) is False
    assert check_sync_batch_norm(_with(base, model__sync_batch_norm=True), 2) is True


@pytest.mark.parametrize("keys,names", [
    ({"parallel__pipeline_stages": 2}, "parallel.pipeline_stages"),
    ({"policy__name": "cadence"}, "policy=cadence"),
    ({"device__kind": "cuda"}, "device=cuda"),
])
def test_what_it_cannot_run_with_is_one_error(base, keys, names):
    """(Under comm.on_failure=shrink|spare: resilience's refusal, tests/unit/resilience/test_on_failure_refusals.py.)"""
    with pytest.raises(ConfigError) as e:
        check_sync_batch_norm(_with(base, model__sync_batch_norm=True, **keys), 2)
    assert "model.sync_batch_norm=true" in str(e.value) and names in str(e.value)
    assert "\n" not in str(e.value)


def test_a_windowed_policy_on_one_rank_has_no_ranks_to_wait_for(base):
    assert check_sync_batch_norm(_with(base, model__sync_batch_norm=True, policy__name="cadence"), 1)


def test_the_start_up_line_counts_the_layers_and_the_values():
    b = GraphBuilder("bn")
    x, y = b.input("x", [None, 3, 4]), b.input("y", [None, 3, 4])
    for name, c, training in (("a", 3, True), ("frozen", 3, False)):
        ps = [b.param(f"{name}.{p}", [c], {"scheme": "ones"}, trainable=p in ("w", "b"))
              for p in ("w", "b", "rm", "rv")]
        x = b.op("batch_norm", x, *ps, training=training)
    b.output("loss", b.op("mse", x, y))
    g = b.build()
    assert batch_norm_channels(g) == [3]          # the frozen one uses its running statistics
    line = describe(g, world_size=2, lanes=1)
    assert "1 batch-norm layer(s)" in line and "13 float64 values" in line
    assert "nothing to sum" in describe(build_model("mlp", input_shape=(4,), num_classes=3, hidden=[5]), 2, 1)
