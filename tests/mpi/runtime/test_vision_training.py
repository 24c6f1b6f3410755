"""torchvision's and timm's image models (tests/support/vision_zoo.py) train on two ranks with the
libraries' defaults: stochastic depth and dropout drawn per lane and step, batch norm on each
lane's micro-batch. The files are TorchScript's training-form exports (a second to export, where
dynamo takes ten; tests/unit/graph/test_vision_models.py checks both exporters' files)."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from tests.support.jobs import explain, read_metrics, train_job

pytest.importorskip("torchvision")
pytest.importorskip("timm")
pytest.importorskip("onnxscript")

# the models test_vision_models.py checks, but for Swin V2 and the MLP-Mixer, whose ops the
# others train (Swin's windows, ConvNeXt's and the transformers' layer norms)
TRAINED = ["tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin", "timm_mobilevit", "timm_levit"]


def _images(path, rows: int = 128):
    """Images whose class is a fixed random linear map of the pixels."""
    from tests.support.vision_zoo import CLASSES, IMAGE
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, *IMAGE)).astype(np.float32)
    w = rng.standard_normal((int(np.prod(IMAGE)), CLASSES))
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, np.argmax(x.reshape(rows, -1) @ w, axis=1).astype(np.int64)
    return path


@pytest.mark.parametrize("name", TRAINED)
def test_a_library_model_trains_on_two_ranks(tmp_path, tmp_path_factory, name):
    from tests.support import onnx_zoo
    from tests.support.shared import run_dir
    _, onnx_file = onnx_zoo.export_zoo_model(name, run_dir(tmp_path_factory, "onnx-zoo"), "torchscript", "train",
                                             optimize=False)
    proc = train_job(2, tmp_path / "run", [f"data.path={_images(tmp_path / 'images.h5')}", "model=onnx",
                                           f"model.path={onnx_file}", "train.batch_size=16", "train.epochs=3",
                                           "data.val_fraction=0.25", "checkpoint=off", "optim=adamw",
                                           "optim.lr=0.003"], timeout=300)
    assert proc.returncode == 0, explain(proc)
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], metrics


# the models issue-named in test_vision_models.py whose dynamo files are checked there: with
# dropout and stochastic depth at p = 0 (optimize=False, as compared with PyTorch) and with the
# libraries' defaults and the exporter's (optimize=True: stochastic depth as Bernoulli draws)
DYNAMO_TRAINED = ["tv_mobilenet_v3", "tv_efficientnet_b0", "tv_convnext", "tv_swin"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a sweep job after four exports: see test_onnx_training.SWEEP_TEST_TIMEOUT
def test_library_models_of_the_dynamo_exporter_train_in_one_job(tmp_path, tmp_path_factory):
    """The dynamo files of MobileNetV3, EfficientNet-B0, ConvNeXt and Swin, each without its
    random layers and with the defaults of the library and of the exporter, train on two ranks
    in one job (a sweep over the files), the loss falling for every one."""
    from tests.mpi.runtime.test_onnx_training import assert_losses_fall, train_sweep
    from tests.support import onnx_zoo
    from tests.support.shared import run_dir
    from tests.support.vision_zoo import NO_DROP
    cache = run_dir(tmp_path_factory, "onnx-zoo")
    files = [onnx_zoo.export_zoo_model(name + suffix, cache, "dynamo", "train", optimize=optimize)[1]
             for name in DYNAMO_TRAINED for suffix, optimize in ((NO_DROP, False), ("", True))]
    metrics = train_sweep(tmp_path, files, [f"data.path={_images(tmp_path / 'images.h5')}", "train.batch_size=16",
                                            "train.epochs=3", "data.val_fraction=0.25", "optim=adamw",
                                            "optim.lr=0.003"], timeout=600)
    assert_losses_fall(metrics)
