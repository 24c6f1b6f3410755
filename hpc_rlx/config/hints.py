"""Suggestions for an unknown config key (pure logic, plus reading the group option files).

A key is often right but in the wrong section (`train.lr` for `optim.lr`) or belongs to another
option of a group (`optim.betas` exists with `optim=adamw` only). So the leaf name is searched in
the whole composed config first, then in every option of every group, and only then are near
spellings of the full key offered.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import OmegaConf

# config groups whose options are files <group>/<option>.yaml packaged under the group name
_GROUPS = ("model", "data", "optim", "policy", "device", "checkpoint")


def flatten_keys(d: dict, prefix: str = "") -> list[str]:
    """Every dotted key of a nested dict, sections included ('train', 'train.epochs')."""
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        out.append(path)
        if isinstance(v, dict):
            out.extend(flatten_keys(v, path + "."))
    return out


def group_option_keys(config_dir) -> dict[str, list[str]]:
    """{'optim.betas': ['optim=adamw'], ...}: the keys of every group option file."""

    found: dict[str, list[str]] = {}
    for group in _GROUPS:
        for f in sorted(Path(config_dir, group).glob("*.yaml")):
            try:
                body = OmegaConf.to_container(OmegaConf.load(f), resolve=False)
            except Exception:  # noqa: BLE001 - a hint source, never a reason to fail
                continue
            if isinstance(body, dict):
                for key in flatten_keys(body, f"{group}."):
                    found.setdefault(key, []).append(f"{group}={f.stem}")
    return found


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def suggest_keys(key: str, known: list[str], other_options: dict[str, list[str]] | None = None,
                 n: int = 2) -> list[str]:
    """Suggestions, best first, ready to print: "'optim.lr'" or "'optim.betas' (with optim=adamw)"."""
    leaf = _leaf(key)
    known_set = set(known)
    # 1. the same leaf elsewhere in the composed config: a key in the wrong section
    same_leaf = [k for k in known if _leaf(k) == leaf and k != key and "." in k]
    if same_leaf:
        return [repr(k) for k in same_leaf[:n]]
    # 2. the same leaf in another option of a group (not selected now)
    other = other_options or {}
    elsewhere = [f"{k!r} (with {' or '.join(opts)})" for k, opts in sorted(other.items())
                 if _leaf(k) == leaf and k not in known_set]
    if elsewhere:
        return elsewhere[:n]
    # 3. near spellings of the whole key, then of the leaf alone (selected options)
    close = difflib.get_close_matches(key, known, n=n, cutoff=0.75)
    if close:
        return [repr(k) for k in close]
    leaves = {}
    for k in known:
        leaves.setdefault(_leaf(k), k)
    near = difflib.get_close_matches(leaf, list(leaves), n=n, cutoff=0.8)
    if near:
        return [repr(leaves[m]) for m in near]
    # 4. near spellings among the keys of the options not selected
    unselected = [k for k in other if k not in known_set]
    return [f"{k!r} (with {' or '.join(other[k])})"
            for k in difflib.get_close_matches(key, unselected, n=n, cutoff=0.75)]
