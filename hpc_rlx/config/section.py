"""A TrainSpec section (`spec.train`, `spec.optim`, ...) as a read-only mapping of the keys its
declaration has: `config/schema.py` for every section but `policy`, whose keys the selected
policy class declares (`Policy.defaults`, `policies/`).

Reading a key nobody declared (`spec.train["epoch"]`, `spec.comm.get("overlapp", False)`) raises
`UndeclaredKey` at the first read instead of silently giving a default, and so does building a
section with such a key. A declared key the section lacks (a key of another option of a group,
`optim.momentum` under `optim=adamw`) reads as a dict's would: KeyError, or `get`'s default.
A section is never written to; its JSON form is the plain dict (`dict(section)`).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from hpc_rlx.config import schema
from hpc_rlx.policies.registry import POLICIES

SECTIONS: tuple[str, ...] = ("train", "optim", "policy", "device", "comm", "checkpoint", "debug",
                             "parallel", "report", "trace")
"""The TrainSpec fields that are config sections."""


class UndeclaredKey(LookupError):
    """A config key read or given that its section does not declare: a mistake in the code."""


def declared(name: str, values: Mapping[str, Any]) -> frozenset[str]:
    """The keys section `name` may hold (of `policy`: the selected policy's)."""
    if name == "policy":
        policy = POLICIES.get(values.get("name"))
        return frozenset({"name", *(policy.defaults if policy is not None else ())})
    return frozenset(k.name for k in schema.keys_of(name))


class Section(Mapping):
    """One config section: the values as validated, readable only by declared keys."""

    def __init__(self, name: str, values: Mapping[str, Any]):
        values = dict(values)
        keys = declared(name, values)
        unknown = sorted(set(values) - keys)
        if unknown:
            raise UndeclaredKey(f"{name}: {unknown} not declared for this section "
                                f"(hpc_rlx/config/schema.py, or the policy's `defaults`)")
        self.name, self._values, self._keys = name, values, keys

    def _known(self, key: str) -> None:
        if key not in self._keys:
            raise UndeclaredKey(f"{self.name}.{key} is not a declared config key "
                                f"(declared: {sorted(self._keys)})")

    def __getitem__(self, key: str):
        self._known(key)
        return self._values[key]

    def get(self, key: str, default=None):
        self._known(key)
        return self._values.get(key, default)

    def __contains__(self, key) -> bool:
        self._known(key)
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other) -> bool:
        return dict(self) == (dict(other) if isinstance(other, Mapping) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._values)      # what the plain dict showed (debug log lines)


def section(name: str, values: Mapping[str, Any]) -> Section:
    """`values` as section `name` (a Section stays as it is)."""
    return values if isinstance(values, Section) and values.name == name else Section(name, values)
