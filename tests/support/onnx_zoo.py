"""A small model zoo in plain PyTorch for the ONNX import tests, and a helper that exports one
with either exporter in either mode.

Each model stays under 200k parameters with inputs of at most 16x16 pixels (or 8 tokens), so
an export and a gradient check take about a second. ``randomize`` gives every parameter and
batch-norm statistic distinct random values: the dynamo exporter's optimizer merges
initializers of equal value (freshly initialised layer-norm weights are all ones), and
distinct values also let a test find each imported parameter's PyTorch counterpart by value.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.support.shared import exclusive


class LeNet5(nn.Module):
    def __init__(self, c=1, n=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, 6, 5, padding=2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(16 * 2 * 2, 32), nn.Linear(32, n)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool2d(torch.tanh(self.conv2(x)), 3, stride=1, padding=1)  # padded: count_include_pad
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, c=3, n=10):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(c, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.layer1, self.layer2 = BasicBlock(8, 8, 1), BasicBlock(8, 16, 2)
        self.fc = nn.Linear(16, n)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.bn(self.stem(x)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MobileNet(nn.Module):
    """A depthwise-separable block: ReLU6 stem, depthwise 3x3, pointwise 1x1, dropout head."""

    def __init__(self, c=3, n=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(c, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        self.dw, self.bn1 = nn.Conv2d(16, 16, 3, 1, 1, groups=16, bias=False), nn.BatchNorm2d(16)
        self.pw, self.bn2 = nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32)
        self.drop, self.head = nn.Dropout(0.1), nn.Linear(32, n)

    def forward(self, x):
        x = F.relu(self.bn2(self.pw(F.relu(self.bn1(self.dw(self.stem(x)))))))
        return self.head(self.drop(x.mean((2, 3))))


class ViT(nn.Module):
    """Patch convolution, class token, pre-LN blocks of PyTorch multi-head attention, exact GELU."""

    def __init__(self, c=3, n=10, img=16, p=4, d=32, heads=2, depth=2):
        super().__init__()
        self.patch = nn.Conv2d(c, d, p, p)
        t = (img // p) ** 2
        self.cls, self.pos = nn.Parameter(torch.zeros(1, 1, d)), nn.Parameter(torch.zeros(1, t + 1, d))
        self.blocks = nn.ModuleList([nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), attn=nn.MultiheadAttention(d, heads, batch_first=True),
            ln2=nn.LayerNorm(d), fc1=nn.Linear(d, 2 * d), fc2=nn.Linear(2 * d, d))) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, n)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for b in self.blocks:
            h = b["ln1"](x)
            x = x + b["attn"](h, h, h, need_weights=False)[0]
            x = x + b["fc2"](F.gelu(b["fc1"](b["ln2"](x))))
        return self.head(self.ln(x)[:, 0])


class GPT(nn.Module):
    """Token and position embeddings, causal self-attention, pre-LN blocks, a tied or own head."""

    def __init__(self, v=32, t=8, d=32, heads=2, depth=2, tied=True):
        super().__init__()
        self.tok, self.pos, self.h, self.tied = nn.Embedding(v, d), nn.Embedding(t, d), heads, tied
        self.blocks = nn.ModuleList([nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), proj=nn.Linear(d, d),
            ln2=nn.LayerNorm(d), fc1=nn.Linear(d, 4 * d), fc2=nn.Linear(4 * d, d))) for _ in range(depth)])
        self.ln = nn.LayerNorm(d)
        if not tied:
            self.lm_head = nn.Linear(d, v, bias=False)
        self.register_buffer("mask", torch.tril(torch.ones(t, t, dtype=torch.bool)))

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).split(x.shape[-1], dim=2)
            q, k, v = [z.view(B, T, self.h, -1).transpose(1, 2) for z in (q, k, v)]
            a = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
            a = a.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(-1)
            x = x + b["proj"]((a @ v).transpose(1, 2).reshape(B, T, -1))
            x = x + b["fc2"](F.gelu(b["fc1"](b["ln2"](x))))
        x = self.ln(x)
        return x @ self.tok.weight.t() if self.tied else self.lm_head(x)


class Mixer(nn.Module):
    """MLP-Mixer: token-mixing MLPs across patches (linear layers on the transposed tokens)."""

    def __init__(self, c=3, n=10, img=16, p=4, d=32, depth=2):
        super().__init__()
        t = (img // p) ** 2
        self.stem = nn.Conv2d(c, d, p, p)
        self.blocks = nn.ModuleList([nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), tok1=nn.Linear(t, 2 * t), tok2=nn.Linear(2 * t, t),
            ln2=nn.LayerNorm(d), ch1=nn.Linear(d, 2 * d), ch2=nn.Linear(2 * d, d))) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, n)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for b in self.blocks:
            y = b["ln1"](x).transpose(1, 2)
            x = x + b["tok2"](F.gelu(b["tok1"](y))).transpose(1, 2)
            x = x + b["ch2"](F.gelu(b["ch1"](b["ln2"](x))))
        return self.head(self.ln(x).mean(1))


class OpsMix(nn.Module):
    """The ops the other models leave out: dilated convolution, leaky ReLU, a sigmoid gate,
    sum and power reductions, sqrt, exp, log, negation and log-softmax outputs."""

    def __init__(self, c=3, n=10):
        super().__init__()
        self.conv = nn.Conv2d(c, 8, 3, padding=2, dilation=2)
        self.gate, self.fc = nn.Linear(8, 8), nn.Linear(8, n)

    def forward(self, x):
        h = F.leaky_relu(self.conv(x), 0.2)
        s = h.sum((2, 3)) / 64.0
        s = s * torch.sigmoid(self.gate(s)) - torch.sqrt(s * s + 1.0)
        s = torch.log(torch.exp(-s) + 1.0) + s.pow(3) * 0.1
        return F.log_softmax(self.fc(s), dim=-1)


class Signal(nn.Module):
    """1-D convolution and pooling over (C, L) signals."""

    def __init__(self, c=3, n=10):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(c, 8, 3, padding=1), nn.Conv1d(8, 8, 3, stride=2, dilation=2, padding=2)
        self.fc = nn.Linear(8 * 2, n)

    def forward(self, x):
        x = F.max_pool1d(F.relu(self.conv1(x)), 2)
        x = F.avg_pool1d(torch.tanh(self.conv2(x)), 3, stride=2, padding=1)
        return self.fc(torch.flatten(x, 1))


class RecurrentText(nn.Module):
    """Token embeddings, a recurrent layer (batch first), its last step to a linear head."""

    def __init__(self, kind, v=32, d=16, hidden=16, n=10, **options):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.rnn = kind(d, hidden, batch_first=True, **options)
        self.fc = nn.Linear(hidden * (2 if self.rnn.bidirectional else 1), n)

    def forward(self, idx):
        y, _ = self.rnn(self.emb(idx))
        return self.fc(y[:, -1])


class UNet(nn.Module):
    """A two-level U-Net whose decoder output is averaged into class logits. ``up``:
    "transposed" upsamples with ConvTranspose2d (the second with output_padding),
    "interpolate" with a bilinear then a nearest nn.Upsample. On odd inputs F.pad grows each
    upsampled map to its skip connection's size (15 -> 7 -> 3 up to 6, padded to 7; up to 14,
    padded to 15)."""

    def __init__(self, c=3, n=10, up="transposed"):
        super().__init__()
        self.up_kind = up
        self.enc1, self.enc2, self.mid = nn.Conv2d(c, 8, 3, padding=1), nn.Conv2d(8, 12, 3, padding=1), \
            nn.Conv2d(12, 12, 3, padding=1)
        if up == "transposed":
            self.up2 = nn.ConvTranspose2d(12, 12, 2, stride=2)
            self.up1 = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1)
        else:
            self.up2 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
            self.up1 = nn.Upsample(scale_factor=2, mode="nearest")
        self.dec2, self.dec1 = nn.Conv2d(24, 8, 3, padding=1), nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, n)

    @staticmethod
    def _fit(x, skip):
        dh, dw = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        return F.pad(x, [dw // 2, dw - dw // 2, dh // 2, dh - dh // 2])

    def forward(self, x):
        s1 = F.relu(self.enc1(x))
        s2 = F.relu(self.enc2(F.max_pool2d(s1, 2)))
        h = F.relu(self.mid(F.max_pool2d(s2, 2)))
        h = F.relu(self.dec2(torch.cat([self._fit(self.up2(h), s2), s2], 1)))
        h = F.relu(self.dec1(torch.cat([self._fit(self.up1(h), s1), s1], 1)))
        return self.head(h.mean((2, 3)))


class GroupNormNet(nn.Module):
    """Group norm as audio encoders and U-Nets use it (both exporters write InstanceNormalization
    between reshapes): 2 groups of 4 channels, one group per channel (wav2vec2's first layer),
    and InstanceNorm2d with its own affine."""

    def __init__(self, c=3, n=10):
        super().__init__()
        self.conv1, self.gn1 = nn.Conv2d(c, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.conv2, self.gn2 = nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(8, 8)
        self.inorm, self.fc = nn.InstanceNorm2d(8, affine=True), nn.Linear(8, n)

    def forward(self, x):
        h = F.gelu(self.gn1(self.conv1(x)))
        h = F.silu(self.inorm(self.gn2(self.conv2(h)) + h))
        return self.fc(h.mean((2, 3)))


class LastToken(nn.Module):
    """A decoder-only classifier's pooling, as transformers writes it: per-token logits, then
    each row's entry at its last non-padding token (id 0 pads), found by an ArgMax over the
    positions times the mask and picked by ``logits[arange(batch), index]``."""

    def __init__(self, v=32, d=16, n=10):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(v, d), nn.Linear(d, d), nn.Linear(d, n)

    def forward(self, idx):
        logits = self.head(torch.tanh(self.fc(self.emb(idx))).cumsum(1))
        last = (torch.arange(idx.shape[1]) * (idx != 0).int()).argmax(-1)
        return logits[torch.arange(idx.shape[0]), last]


class Relative(nn.Module):
    """DeBERTa's ops on run-time data: the sign of the token ids' differences (int64) picks a
    relative-position embedding, shared keys are repeated per sample (Tile by the batch size)
    and gathered per score, and sign(h) scales h (no gradient through the sign)."""

    def __init__(self, v=32, d=16, n=10, t=8):
        super().__init__()
        self.emb, self.rel = nn.Embedding(v, d), nn.Embedding(3, 1)
        self.keys, self.head = nn.Parameter(torch.zeros(2, t, d)), nn.Linear(d, n)

    def forward(self, idx):
        b, t = idx.shape
        h = self.emb(idx)                                            # (b, t, d)
        side = torch.sign(idx[:, :, None] - idx[:, None, :]) + 1      # (b, t, t) in 0..2
        keys = self.keys.repeat(b, 1, 1).view(b, 2, t, -1)           # (2b, t, d) -> (b, 2, t, d)
        scores = (h[:, None] @ keys.transpose(-1, -2)).sum(1)        # (b, t, t)
        scores = scores + self.rel(side)[..., 0]
        h = torch.softmax(scores, -1) @ (h * torch.sign(h))
        return self.head(h.mean(1))


# name -> (constructor, one sample's input shape, token vocabulary or None for float inputs)
ZOO = {
    "lenet": (LeNet5, (1, 12, 12), None),
    "resnet": (ResNet, (3, 16, 16), None),
    "mobilenet": (MobileNet, (3, 16, 16), None),
    "vit": (ViT, (3, 16, 16), None),
    "gpt": (GPT, (8,), 32),
    "gpt_untied": (lambda: GPT(tied=False), (8,), 32),
    "mixer": (Mixer, (3, 16, 16), None),
    "opsmix": (OpsMix, (3, 8, 8), None),
    "signal": (Signal, (3, 16), None),
    "unet_transposed": (UNet, (3, 15, 15), None),
    "unet_interpolate": (lambda: UNet(up="interpolate"), (3, 15, 15), None),
    "lstm_text": (lambda: RecurrentText(nn.LSTM), (8,), 32),
    "gru_text": (lambda: RecurrentText(nn.GRU, num_layers=2, bidirectional=True), (8,), 32),
    "groupnorm": (GroupNormNet, (3, 8, 8), None),
    "last_token": (LastToken, (8,), 32),
    "relative": (Relative, (8,), 32),
}


def randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Distinct random values for every float parameter and buffer (variances positive)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.dtype.is_floating_point:
                continue
            r = torch.rand(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            if name.endswith("running_var") or (name.endswith("weight") and p.dim() == 1):
                p.copy_(0.5 + r)  # variances and norm scales around 1
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.copy_((2 * r - 1) * (0.2 if p.dim() == 1 else fan_in ** -0.5 * 1.5))
    return module


def entry(name: str) -> tuple:
    """ZOO's entry, else tests/support/vision_zoo.py's (torchvision and timm) or hf_zoo.py's
    (Hugging Face), those imported only then."""
    if name in ZOO:
        return ZOO[name]
    from tests.support.vision_zoo import VISION_ZOO
    if name in VISION_ZOO:
        return VISION_ZOO[name]
    from tests.support.hf_zoo import HF_ZOO
    return HF_ZOO[name]


def make(name: str, seed: int = 0) -> nn.Module:
    return randomize(entry(name)[0](), seed)


def sample_input(name: str, batch: int, seed: int = 0) -> torch.Tensor:
    _, shape, vocab = entry(name)
    g = torch.Generator().manual_seed(seed)
    if vocab:
        tokens = torch.randint(0, vocab, (batch, *shape), generator=g)
        if name in ZOO:
            return tokens
        from tests.support.hf_zoo import end_sequences
        return end_sequences(name, tokens)
    return torch.randn((batch, *shape), generator=g)


def has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def has_group_norm(module: nn.Module) -> bool:
    """GroupNorm's weight and bias: dynamo's optimizer folds their reshape to (C, 1, 1) into new
    initializers, which train apart from the PyTorch parameters (the import warns)."""
    return any(isinstance(m, nn.GroupNorm) for m in module.modules())


def exports_by_mode(module: nn.Module) -> bool:
    """Whether module.train() and module.eval() can export different graphs: batch norm,
    dropout, or attention (whose PyTorch forward takes other paths in eval mode)."""
    kinds = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.MultiheadAttention)
    return any(isinstance(m, kinds) for m in module.modules())


def export(module: nn.Module, example: torch.Tensor, path, exporter: str, mode: str, optimize: bool = True,
           opset: int | None = None):
    """Write ``module`` as ONNX at ``path``: ``exporter`` "dynamo" (torch.onnx.export(dynamo=True),
    with its graph optimizer unless ``optimize`` is false) or "torchscript" (dynamo=False, constant
    folding in eval mode only); ``mode`` "train" (module.train(); TorchScript's TRAINING form) or
    "eval"; ``opset`` the opset version (the exporter's default if None). The batch dim is
    dynamic. Returns ``path``.

    Exporting runs the module once; in training mode that moves its batch-norm running
    statistics, and the TorchScript exporter writes the moved values. The module is left
    holding the statistics the file holds."""
    module.train(mode == "train")
    state = {k: v.clone() for k, v in module.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(module, (example,), str(path), dynamo=True, optimize=optimize, verbose=False,
                              opset_version=opset,
                              input_names=["x"], output_names=["logits"],
                              dynamic_shapes=({0: torch.export.Dim("batch")},))
        else:
            training = torch.onnx.TrainingMode.TRAINING if mode == "train" else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(module, (example,), str(path), dynamo=False, input_names=["x"],
                              output_names=["logits"], dynamic_axes={"x": {0: "batch"}}, training=training,
                              do_constant_folding=mode != "train" and optimize,
                              **({"opset_version": opset} if opset else {}))
    module.load_state_dict(state)
    return hold_file_buffers(module, path)


def hold_file_buffers(module: nn.Module, path):
    """Set ``module``'s buffers (batch norm's running statistics) to the values the ONNX file at
    ``path`` holds, where the file has them; returns ``path``."""
    import onnx
    from onnx import numpy_helper

    written = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    with torch.no_grad():
        for key, value in module.named_buffers():
            if key in written and tuple(written[key].dims) == tuple(value.shape):
                value.copy_(torch.from_numpy(numpy_helper.to_array(written[key]).copy()))
    return path


def fresh(name: str, seed: int = 0) -> nn.Module:
    """The model ``name`` as its constructor initialises it (torch's generator seeded with
    ``seed``), without ``randomize``: freshly initialised layer norms hold equal ones and zeros,
    which the dynamo exporter's optimizer merges, as it does for a user's new model."""
    torch.manual_seed(seed)
    return entry(name)[0]()


def export_zoo_model(name: str, cache_dir, exporter: str, mode: str, optimize: bool = True,
                     batch: int = 3, seed: int = 1, weights: str = "random") -> tuple[nn.Module, Path]:
    """``make(name)`` exported as ``export`` does it with ``sample_input(name, batch, seed)``,
    through a file cache in ``cache_dir`` that the test modules and pytest-xdist workers of one
    run share (see ``tests.support.shared.run_dir``): a dynamo export takes seconds, and the same
    file serves the import, training and export tests. ``weights="fresh"`` exports ``fresh(name)``
    instead (the exporters' defaults on a new model). Returns the module (holding the file's
    buffers, as after ``export``) and the file."""
    module = make(name) if weights == "random" else fresh(name)
    # dynamo exports a model without mode-dependent layers to one graph in both modes: one file
    # serves both (TorchScript's flags differ by mode: constant folding in eval)
    file_mode = "any" if exporter == "dynamo" and not exports_by_mode(module) else mode
    tag = "" if weights == "random" else f"-{weights}"
    path = Path(cache_dir) / (f"{name}-{exporter}-{file_mode}-{'opt' if optimize else 'plain'}{tag}"
                              f"-b{batch}s{seed}.onnx")
    with exclusive(path.with_suffix(".lock")):
        if path.exists():
            module.train(mode == "train")
            return module, hold_file_buffers(module, path)
        partial = path.with_suffix(".partial.onnx")
        export(module, sample_input(name, batch, seed=seed), partial, exporter, mode, optimize)
        os.replace(partial, path)
    return module, path
