"""The vocabulary of the config's declarations: a `Key`, a group key's `Options`, and the
groups (`model=`, `data=`, ...) with their options. `config/schema.py` holds the table and the
checks; the sections that grow with features declare their keys in modules of their own
(`config/keys_data.py`, `config/keys_model.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_rlx.base.checks import BOOL, INT64, Check
from hpc_rlx.optim.registry import OPTIMIZERS as _OPTIMIZERS
from hpc_rlx.policies.registry import POLICIES


class Options(dict):
    """A group key's defaults, by the group options that have the key."""


def every(options: tuple[str, ...], value) -> Options:
    return Options((o, value) for o in options)


@dataclass(frozen=True)
class Key:
    path: str                   # "train.epochs"; "resume" for a top-level key
    type: Any                   # a type or a tuple of types; None is always allowed as a value
    default: Any                # the default, or Options for a key of a group section
    doc: str                    # one line: what it does, and its choices
    check: Check | None = None  # None: any value (or checked where it is used: see the doc)
    label: str | None = None    # the name in messages when it is not `path`

    @property
    def section(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.path.split(".", 1)[-1]

    def options(self) -> tuple[str, ...] | None:
        return tuple(self.default) if isinstance(self.default, Options) else None

    def default_for(self, option: str | None = None):
        return self.default[option] if isinstance(self.default, Options) else self.default

    def validate(self, value, world_size: int | None = None) -> None:
        INT64(self.label or self.path, value)    # every key, its own check or none
        # a bool key without a check of its own still takes true or false only
        check = BOOL if self.check is None and self.type is bool else self.check
        if check is not None:
            check(self.label or self.path, value, world_size)


# group -> (the key that names the option, its options in the order docs/config.md lists them,
# the option config.yaml selects)
GROUPS: dict[str, tuple[str | None, tuple[str, ...], str]] = {
    "model": ("name", ("mlp", "cnn", "transformer_lm", "graph", "onnx"), "mlp"),
    "data": ("name", ("digits", "synthetic", "text", "file"), "digits"),
    "optim": ("name", tuple(_OPTIMIZERS), "sgd"),
    "policy": ("name", tuple(POLICIES), "sync"),
    "device": ("kind", ("cpu", "cuda", "all", "auto"), "cpu"),
    "checkpoint": (None, ("default", "off"), "default"),
}
MODELS, DATASETS = GROUPS["model"][1], GROUPS["data"][1]
OPTIMIZERS, DEVICES = GROUPS["optim"][1], GROUPS["device"][1]


def selector(group: str, option_key: str, options, check: Check | None = None) -> Key:
    return Key(f"{group}.{option_key}", str, Options((o, o) for o in options),
               f"the option of `{group}=`", check, label=group)
