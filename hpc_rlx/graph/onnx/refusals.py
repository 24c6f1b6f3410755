"""The import's one error for every node it cannot take (importer._walk collects them)."""

from __future__ import annotations

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.onnx.scopes import describe

# What a user most likely has behind an op type, where the op alone does not say.
_CAUSES = {
    "RandomUniform": "a random tensor of a fixed shape drawn in the model",
    "RandomNormal": "noise of a fixed shape drawn in the model",
}
_SHOWN_PER_OP = 3     # nodes named per op type in the error; the count gives the rest


def _op_name(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def unsupported_error(missing: list, data_bound: list, refused: list, trained: list,
                      folded: list) -> GraphError:
    """One error for every node the import cannot take, grouped by op type with counts:
    `missing` ops hpc_rlx does not have, `data_bound` ops it has only for constants, `refused`
    (node, reason) pairs of ops it has but not in the form the node uses (a 3-D ConvTranspose,
    a cubic Resize), grouped by op type and reason; `trained` and `folded`: the op types
    taken on data and on constants only (importer.supported_ops)."""
    data_reason = "supported only on constants and shapes, but here an input depends on the data"
    lines = []
    for pairs in ([(n, "not supported") for n in missing], [(n, data_reason) for n in data_bound], refused):
        by_op: dict = {}
        for node, reason in pairs:
            by_op.setdefault((_op_name(node), reason), []).append(node)
        for (op, reason), group in sorted(by_op.items()):
            shown = ", ".join(describe(n) for n in group[:_SHOWN_PER_OP])
            more = f" and {len(group) - _SHOWN_PER_OP} more" if len(group) > _SHOWN_PER_OP else ""
            cause = f" [{_CAUSES[op]}]" if op in _CAUSES else ""
            lines.append(f"  {op} x{len(group)}: {reason}{cause}; {shown}{more}")
    count = len(missing) + len(data_bound) + len(refused)
    return GraphError(f"the ONNX file has {count} node(s) hpc_rlx cannot import:\n" + "\n".join(lines)
                      + f"\nops that train: {', '.join(trained)}\n"
                      + f"ops on constants and shapes only: {', '.join(folded)}")
