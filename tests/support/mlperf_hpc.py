"""Mini CosmoFlow and mini DeepCAM: the two MLPerf HPC workloads at test sizes, in plain PyTorch,
with their data written in the layouts the reference trainers read (mlcommons/hpc).

- **CosmoFlow** (``cosmoflow/models/cosmoflow.py``): 5 x (Conv3D k=2 'same' + LeakyReLU +
  MaxPool3D), two dense layers with dropout, tanh x 1.2; 4 targets, MSE loss. The reference
  reads channels-last int16 counts (``prepare.py`` cuts 128^3 x 4 sub-volumes out of each 512^3
  universe, as HDF5 ``x``/``y`` or as TFRecords) and takes log(1 + x) in its input pipeline;
  here the model does it, so the files stay int16 and the ranks hold the stored bytes.
  Sample: ``x`` (32, 32, 32, 4) int16, ``y`` (4,) float32, one sample per file.
- **DeepCAM** (``deepcam/src/deepCam``): a DeepLabv3+ (a strided encoder, an atrous
  convolution, ASPP with image pooling, a decoder joining low-level features, bilinear
  upsampling, batch norm) on 16-channel climate images. The reference data set is one file
  per sample, ``climate/data`` (H, W, 16) float32 channels last and ``climate/labels_0`` (H, W)
  with 3 classes, beside a ``stats.h5`` whose per-channel ``climate/minval`` / ``maxval`` it
  normalises with ``(x - minval) / (maxval - minval)`` and then transposes to NCHW in its
  reader; here both happen in the model, from the statistics given to its constructor.

``write_cosmoflow`` / ``write_deepcam`` write directories of one-sample files, learnable
(CosmoFlow: each channel's mean count follows one target; DeepCAM: the classes follow two
channels' values); the returned dict names the directories and files.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

COSMO_SHAPE = (32, 32, 32, 4)        # D, H, W, channels: channels last, as prepare.py cuts them
DEEPCAM_SHAPE = (96, 144, 16)        # H, W, channels (the reference's 768 x 1152 x 16, 8x smaller)
DEEPCAM_CLASSES = 3                  # background, tropical cyclone, atmospheric river


class MiniCosmoFlow(nn.Module):
    """CosmoFlow at 32^3: conv channels ``base * 2**i`` (the reference's conv_size=32, here 4)."""

    def __init__(self, channels: int = 4, n_conv: int = 5, base: int = 4, fc1: int = 32, fc2: int = 16,
                 dropout: float = 0.5, kernel: int = 2):
        super().__init__()
        layers, c = [], channels
        for i in range(n_conv):
            layers += [nn.Conv3d(c, base * 2 ** i, kernel, padding="same"), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            c = base * 2 ** i
        self.convs = nn.Sequential(*layers)
        side = COSMO_SHAPE[0] // 2 ** n_conv
        self.fc1, self.fc2 = nn.Linear(c * side ** 3, fc1), nn.Linear(fc1, fc2)
        self.out = nn.Linear(fc2, 4)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        # the counts (B, D, H, W, C) as stored; hpc_rlx casts each int16 batch to train.dtype
        x = torch.log1p(x.permute(0, 4, 1, 2, 3))
        x = torch.flatten(self.convs(x), 1)
        x = self.drop(F.leaky_relu(self.fc1(x), 0.3))        # Keras' LeakyReLU: alpha 0.3
        x = self.drop(F.leaky_relu(self.fc2(x), 0.3))
        return torch.tanh(self.out(x)) * 1.2


def _conv_bn(cin: int, cout: int, k: int = 3, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    pad = dilation * (k - 1) // 2
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, pad, dilation, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling: a 1x1 branch, two atrous 3x3 branches and image pooling
    (global mean, 1x1 conv, spread back by bilinear resize), joined by a 1x1 conv."""

    def __init__(self, cin: int, cout: int, rates=(2, 4)):
        super().__init__()
        self.branches = nn.ModuleList([_conv_bn(cin, cout, 1)] + [_conv_bn(cin, cout, 3, dilation=r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cin, cout, 1, bias=False), nn.ReLU())
        self.project = _conv_bn(cout * (len(rates) + 2), cout, 1)

    def forward(self, x):
        pooled = F.interpolate(self.pool(x), size=x.shape[-2:], mode="bilinear", align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], 1))


class MiniDeepCAM(nn.Module):
    """DeepLabv3+ at output stride 4 on (B, H, W, 16) channels-last images; ``minval`` and
    ``maxval`` (16 each) from ``stats.h5`` normalise inside the model."""

    def __init__(self, minval, maxval, channels: int = 16, classes: int = DEEPCAM_CLASSES, width: int = 16):
        super().__init__()
        minval, maxval = np.asarray(minval, np.float32), np.asarray(maxval, np.float32)
        # buffers, not parameters: the export writes them as constants that do not train
        self.register_buffer("shift", torch.from_numpy(minval), persistent=False)
        self.register_buffer("scale", torch.from_numpy(1.0 / (maxval - minval)), persistent=False)
        self.stem = _conv_bn(channels, width, stride=2)                 # /2: the low-level features
        self.down = _conv_bn(width, 2 * width, stride=2)                # /4
        self.atrous = _conv_bn(2 * width, 2 * width, dilation=2)        # the encoder's atrous conv
        self.aspp = ASPP(2 * width, 2 * width)
        self.low = _conv_bn(width, width // 2, 1)
        self.decode = _conv_bn(2 * width + width // 2, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x):
        x = ((x - self.shift) * self.scale).permute(0, 3, 1, 2)        # NHWC -> NCHW, as the reader did
        low = self.stem(x)
        y = self.aspp(self.atrous(self.down(low)))
        y = F.interpolate(y, size=low.shape[-2:], mode="bilinear", align_corners=False)
        y = self.head(self.decode(torch.cat([y, self.low(low)], 1)))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


def as_imported(module: nn.Module) -> nn.Module:
    """``module`` in float64 with its constant buffers (DeepCAM's statistics) as the import
    reads float32 constants: the shortest decimal of each value (``emit.constant``), so that a
    float64 PyTorch loop computes with the numbers hpc_rlx trains with."""
    from hpc_rlx.graph.onnx.emit import decimal32
    module = module.double()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                continue                    # running statistics: buffers the import keeps exact
            for b in m.buffers(recurse=False):
                if b.is_floating_point():
                    b.copy_(torch.tensor([decimal32(v) for v in b.float().tolist()], dtype=torch.float64))
    return module


def read_stats(path) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as f:
        return f["climate/minval"][...], f["climate/maxval"][...]


def export(module: nn.Module, example: torch.Tensor, path, exporter: str = "dynamo") -> Path:
    """``module`` in training mode as ONNX with a dynamic batch (input "x")."""
    from tests.support import onnx_zoo
    return onnx_zoo.export(module, example, path, exporter, "train", optimize=False)


# ---------------------------------------------------------------- data in the native layouts


def cosmoflow_sample(rng, shape=COSMO_SHAPE):
    """int16 counts whose log-mean per channel follows one of the 4 targets in [-1, 1]."""
    y = rng.uniform(-1, 1, 4).astype(np.float32)
    rate = np.exp(1.5 + y)                                              # per channel
    x = rng.poisson(rate, shape).astype(np.int16)
    return x, y


def write_cosmoflow(root, train: int = 8, val: int = 4, seed: int = 0, shape=COSMO_SHAPE) -> dict:
    """``root/train/univ_NNNN.h5`` and ``root/validation/...``: ``x`` int16 channels last,
    ``y`` 4 float32, one sample per file (prepare.py's split HDF5 files, at ``shape``)."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, n in (("train", train), ("validation", val)):
        d = Path(root) / split
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            x, y = cosmoflow_sample(rng, shape)
            with h5py.File(d / f"univ_{i:04d}.h5", "w") as f:
                f["x"], f["y"] = x, y
        out[split] = d
    return out


def deepcam_sample(rng, minval, maxval, shape=DEEPCAM_SHAPE, ignore: int | None = None):
    """A smooth random field per channel in [minval, maxval]; class 1 where channel 0 is high,
    2 where channel 1 is high (and channel 0 is not); ``ignore``: that label on a 4-pixel border."""
    h, w, c = shape
    coarse = rng.standard_normal((h // 8 + 2, w // 8 + 2, c))
    field = np.kron(coarse, np.ones((8, 8, 1)))[:h, :w] + 0.3 * rng.standard_normal((h, w, c))
    unit = 1 / (1 + np.exp(-field))                                     # in (0, 1)
    x = (minval + unit * (maxval - minval)).astype(np.float32)
    labels = np.zeros((h, w), np.int32)
    labels[unit[..., 1] > 0.75] = 2
    labels[unit[..., 0] > 0.75] = 1
    if ignore is not None:
        labels[:4], labels[-4:], labels[:, :4], labels[:, -4:] = ignore, ignore, ignore, ignore
    return x, labels


def write_deepcam(root, train: int = 8, val: int = 4, seed: int = 0, shape=DEEPCAM_SHAPE,
                  ignore: int | None = None) -> dict:
    """``root/stats.h5`` (climate/minval, climate/maxval), ``root/train/data-NNNN.h5`` and
    ``root/validation/...`` with ``climate/data`` (H, W, C) float32 and ``climate/labels_0``
    (H, W) int32, as the reference's CamDataset reads them."""
    rng = np.random.default_rng(seed)
    c = shape[-1]
    # the variables' own ranges (pressure in Pa beside humidity in kg/kg): why the stats exist
    minval = (10.0 ** rng.uniform(-3, 4, c)).astype(np.float32)
    maxval = (minval * rng.uniform(2, 50, c)).astype(np.float32)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    with h5py.File(root / "stats.h5", "w") as f:
        f["climate/minval"], f["climate/maxval"] = minval, maxval
    out = {"stats": root / "stats.h5"}
    for split, n in (("train", train), ("validation", val)):
        d = root / split
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            x, labels = deepcam_sample(rng, minval, maxval, shape, ignore)
            with h5py.File(d / f"data-{i:04d}.h5", "w") as f:
                f["climate/data"], f["climate/labels_0"] = x, labels
        out[split] = d
    return out
