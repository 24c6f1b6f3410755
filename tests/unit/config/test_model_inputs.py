"""data.x as a list (several model inputs): what start-up refuses, each one ConfigError naming
the setting, and a list of one name that reads as that name."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpc_rlx.base.errors import ConfigError
from hpc_rlx.config.model_inputs import input_sources


def _cfg(path, **over) -> dict:
    data = {"path": str(path), "val_path": None, "val_fraction": 0.25, "x": ["input_ids", "attention_mask"],
            "y": "labels", "cache": "memory", "one_sample_per_file": False}
    data.update(over.pop("data", {}))
    return {"data": data, "model": {"name": over.pop("model", "onnx")},
            "parallel": {"pipeline_stages": over.pop("stages", 1)}}


@pytest.fixture
def h5(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["input_ids"], f["attention_mask"] = np.ones((8, 6), np.int64), np.ones((8, 6), np.int32)
        f["labels"] = np.zeros(8, np.int64)
    return path


@pytest.mark.parametrize("over, message", [
    ({"stages": 2}, r"not supported with parallel\.pipeline_stages=2"),
    ({"model": "mlp"}, r"not supported with model=mlp \(an ONNX file takes them: model=onnx\)"),
    ({"data": {"x": ["input_ids", "input_ids"]}},
     r"each dataset may be named once, and not the labels \(data\.y=labels\)"),
])
def test_what_several_inputs_do_not_support_yet_is_one_config_error(h5, over, message):
    with pytest.raises(ConfigError, match=r"data\.x=\[.*\]: .*" + message):
        input_sources(_cfg(h5, **over))


def test_the_inputs_are_described_packed_and_a_list_of_one_is_that_name(h5):
    src, inputs = input_sources(_cfg(h5))
    assert inputs == [("input_ids", (6,), "int64"), ("attention_mask", (6,), "int32")]
    assert src.info.x_shape == (12,) and src.info.x_dtype == np.int64 and src.n_train == 6
    cfg = _cfg(h5, data={"x": ["input_ids"]})
    src, inputs = input_sources(cfg)
    assert inputs is None and cfg["data"]["x"] == "input_ids" and src.info.x_shape == (6,)
