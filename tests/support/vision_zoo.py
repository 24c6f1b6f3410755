"""Image models from torchvision and timm for the ONNX import tests: the libraries' own classes
in small configurations (random weights, nothing downloaded), as a user would bring them.

Each entry follows tests/support/onnx_zoo.py's ZOO: (constructor, one sample's input shape,
None). ``build(name, drop=False)`` gives the model with its dropout and stochastic depth at
p = 0, as the gradient comparison with PyTorch needs (the random masks are each side's own);
the default, ``drop=True``, keeps the library's defaults, and so the exporters' random ops.
"""

from __future__ import annotations

import functools

IMAGE = (3, 32, 32)
CLASSES = 10
NO_DROP = "_p0"


def _tv():
    import torchvision
    return torchvision.models


def mobilenet_v3(drop):
    """MobileNetV3-Small: HardSwish, HardSigmoid in squeeze-and-excitation."""
    return _tv().mobilenet_v3_small(num_classes=CLASSES, width_mult=0.5, dropout=0.2 if drop else 0.0)


def efficientnet_b0(drop):
    """EfficientNet-B0 as torchvision defines it (stochastic depth 0.2, dropout 0.2), SiLU, SE."""
    return _tv().efficientnet_b0(num_classes=CLASSES, stochastic_depth_prob=0.2 if drop else 0.0,
                                 dropout=0.2 if drop else 0.0)


def convnext(drop):
    """ConvNeXt: depthwise 7x7, LayerNorm2d (a permute around layer norm), layer scale,
    stochastic depth."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return ConvNeXt([CNBlockConfig(16, 32, 2), CNBlockConfig(32, None, 1)],
                    stochastic_depth_prob=0.1 if drop else 0.0, num_classes=CLASSES)


def swin(drop):
    """Swin Transformer: shifted windows (roll, pad), relative position bias (a gather by
    constant index), patch merging."""
    from torchvision.models.swin_transformer import SwinTransformer
    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.1 if drop else 0.0, num_classes=CLASSES)


def swin_v2(drop):
    """Swin V2: cosine attention with a learnt scale, a continuous position bias MLP."""
    from torchvision.models.swin_transformer import SwinTransformer, SwinTransformerBlockV2, PatchMergingV2
    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[2, 2], num_heads=[1, 2], window_size=[4, 4],
                           stochastic_depth_prob=0.1 if drop else 0.0, num_classes=CLASSES,
                           block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)


def resnet18(drop):
    return _tv().resnet18(num_classes=CLASSES)


def shufflenet(drop):
    return _tv().shufflenet_v2_x0_5(num_classes=CLASSES)


def mobilenet_v2(drop):
    return _tv().mobilenet_v2(num_classes=CLASSES, width_mult=0.35, dropout=0.2 if drop else 0.0)


def densenet(drop):
    from torchvision.models.densenet import DenseNet
    return DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16, num_classes=CLASSES,
                    drop_rate=0.1 if drop else 0.0)


def vit(drop):
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             dropout=0.1 if drop else 0.0, num_classes=CLASSES)


def regnet(drop):
    return _tv().regnet_x_400mf(num_classes=CLASSES)


def squeezenet(drop):
    return _tv().squeezenet1_1(num_classes=CLASSES, dropout=0.5 if drop else 0.0)


def _rates(drop: bool, path: bool = True) -> dict:
    rates = dict(drop_rate=0.1 if drop else 0.0)
    if path:  # stochastic depth
        rates["drop_path_rate"] = 0.1 if drop else 0.0
    return rates


def _timm(model_name, drop, path=True, **kw):
    """timm's registered ``model_name``; ``path``: whether it has stochastic depth."""
    import timm
    return timm.create_model(model_name, pretrained=False, num_classes=CLASSES, **_rates(drop, path), **kw)


def timm_mixer(drop):
    from timm.models.mlp_mixer import MlpMixer
    return MlpMixer(num_classes=CLASSES, img_size=32, patch_size=8, num_blocks=2, embed_dim=64, **_rates(drop))


def timm_levit(drop):
    """LeViT: batch norm over (B*tokens, C) rows, attention biases gathered by constant index."""
    from timm.models.levit import Levit
    return Levit(img_size=32, num_classes=CLASSES, embed_dim=(32, 64), key_dim=8, num_heads=(2, 4), depth=(1, 1),
                 **_rates(drop))


TIMM = {
    "timm_resnet10t": ("resnet10t", {}),
    "timm_convnext_atto": ("convnext_atto", {}),
    "timm_deit_tiny": ("deit_tiny_patch16_224", dict(img_size=32, patch_size=8)),
    "timm_mobilevit": ("mobilevit_xxs", {}),
    "timm_lcnet": ("lcnet_050", {}),
    "timm_mobilenetv3": ("mobilenetv3_small_050", {}),
    "timm_efficientnet": ("efficientnet_b0", {}),
    "timm_swin": ("swin_tiny_patch4_window7_224", dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2),
                                                        num_heads=(1, 2))),
    "timm_regnety": ("regnety_002", {}),
    "timm_ghostnet": ("ghostnet_050", dict(path=False)),
    "timm_edgenext": ("edgenext_xx_small", {}),
}

BUILDERS = {
    "tv_mobilenet_v3": mobilenet_v3, "tv_efficientnet_b0": efficientnet_b0, "tv_convnext": convnext,
    "tv_swin": swin, "tv_swin_v2": swin_v2, "tv_resnet18": resnet18, "tv_shufflenet": shufflenet,
    "tv_mobilenet_v2": mobilenet_v2, "tv_densenet": densenet, "tv_vit": vit, "tv_regnet": regnet,
    "tv_squeezenet": squeezenet,
    "timm_mixer": timm_mixer, "timm_levit": timm_levit,
    **{name: functools.partial(_timm, timm_name, **kw) for name, (timm_name, kw) in TIMM.items()},
}


def build(name: str, drop: bool = True):
    """The model ``name`` with random weights; ``drop=False``: dropout and stochastic depth at p=0."""
    return BUILDERS[name](drop)


# name -> (constructor, one sample's shape, None), as onnx_zoo.ZOO; NAME_p0 is the model with
# dropout and stochastic depth at p = 0
VISION_ZOO = {**{name: (functools.partial(build, name), IMAGE, None) for name in BUILDERS},
              **{f"{name}{NO_DROP}": (functools.partial(build, name, drop=False), IMAGE, None) for name in BUILDERS}}
