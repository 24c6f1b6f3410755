"""docs/config.md holds the config table generated from the schema (`python -m hpc_rlx.config.doc`),
exactly, and the table documents every declared key and no other."""

from __future__ import annotations

from pathlib import Path

from hpc_rlx.__main__ import _CONFIG_DIR
from hpc_rlx.config import schema
from hpc_rlx.config.doc import TABLE_BEGIN, TABLE_END, config_table
from hpc_rlx.policies.registry import POLICIES

from tests.docs.doc_blocks import REPO

PAGE = REPO / "docs" / "config.md"


def test_the_config_page_holds_the_generated_config_table():
    page = PAGE.read_text()
    assert TABLE_BEGIN + config_table() + TABLE_END in page, \
        "docs/config.md's config table differs from the schema: python -m hpc_rlx.config.doc prints it"
    table = page.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0]
    documented = {row.split("`")[1] for row in table.splitlines()[2:]}
    declared = {k.path for k in schema.KEYS if not (k.section in schema.GROUPS
                                                   and k.name == schema.GROUPS[k.section][0])}
    declared |= {f"policy.{k}" for cls in POLICIES.values() for k in cls.defaults}
    assert documented == declared, (sorted(documented - declared), sorted(declared - documented))


def test_the_config_page_lists_every_group_option():
    """The Groups line above the table names every option of every config group."""
    groups_line = next(ln for ln in PAGE.read_text().split("\n\n") if ln.startswith("Groups:"))
    for group in sorted(p for p in Path(_CONFIG_DIR).iterdir() if p.is_dir() and p.name != "hydra"):
        options = sorted(y.stem for y in group.glob("*.yaml"))
        listed = next((part for part in groups_line.replace("\n", " ").split("`")
                       if part.startswith(f"{group.name}=")), None)
        assert listed is not None, f"docs/config.md's Groups line does not name {group.name}="
        assert sorted(listed.split("=", 1)[1].split("|")) == options, (group.name, listed, options)
