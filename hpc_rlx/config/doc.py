"""The config table of docs/config.md, generated from the declarations of `config.schema`.

    python -m hpc_rlx.config.doc        # prints the table, between its markers

`tests/docs/test_config_reference.py` fails when docs/config.md does not hold exactly this text.
"""

from __future__ import annotations

from hpc_rlx.config.schema import GROUPS, KEYS, Options
from hpc_rlx.policies.registry import POLICIES


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "???":
        return "-"
    return str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")      # a bar ends a table cell, even inside backticks


def _by_value(defaults: dict[str, object], options: tuple[str, ...]) -> str:
    """`0.2` when every option has that default, else `0.2 (digits, file), 0.1 (text)`."""
    groups: dict[str, list[str]] = {}
    for option, value in defaults.items():
        groups.setdefault(_show(value), []).append(option)
    if len(groups) == 1 and len(defaults) == len(options):
        return next(iter(groups))
    return ", ".join(f"{value} ({', '.join(names)})" for value, names in groups.items())


# the order of the table's sections
ORDER = ("train", "model", "data", "optim", "device", "comm", "parallel", "report", "trace", "checkpoint",
         "resume", "debug")


def config_table() -> str:
    """docs/config.md's config table: one row per key, by section, then `policy.*`."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key in sorted(KEYS, key=lambda k: ORDER.index(k.section)):
        if key.section in GROUPS and key.name == GROUPS[key.section][0]:
            continue                    # the option itself: the Groups line lists them
        shown = (_by_value(dict(key.default), GROUPS[key.section][1]) if isinstance(key.default, Options)
                 else _show(key.default))
        rows.append(f"| `{key.path}` | {_cell(shown)} | {_cell(key.doc)} |")
    declared: dict[str, list[str]] = {}
    for name, cls in POLICIES.items():
        for k in cls.defaults:
            declared.setdefault(k, []).append(name)
    for k, names in declared.items():
        shown = _by_value({n: POLICIES[n].defaults[k] for n in names}, tuple(names))
        doc = f"{POLICIES[names[0]].key_docs[k]} (`policy={'|'.join(names)}`)"
        rows.append(f"| `policy.{k}` | {_cell(shown)} | {_cell(doc)} |")
    return "\n".join(rows) + "\n"


TABLE_BEGIN = "<!-- config table: from hpc_rlx/config/schema.py (python -m hpc_rlx.config.doc) -->\n"
TABLE_END = "<!-- end of config table -->\n"


if __name__ == "__main__":
    print(TABLE_BEGIN + config_table() + TABLE_END, end="")
