"""Where an ONNX node comes from, in the words of the PyTorch model: the dynamo exporter names
nodes `node_Add_12` but records each node's module path in its `pkg.torch.onnx.name_scopes`
metadata (`['', 'features', 'features.2', 'features.2.1.stochastic_depth', 'bernoulli']`)."""

from __future__ import annotations

import ast

NAME_SCOPES = "pkg.torch.onnx.name_scopes"


def module_of(node) -> str | None:
    """The deepest module path that holds `node`, or None when the file does not say."""
    for prop in getattr(node, "metadata_props", ()):
        if prop.key != NAME_SCOPES:
            continue
        try:
            scopes = ast.literal_eval(prop.value)
        except (ValueError, SyntaxError):
            return None
        modules = [s for s in scopes[:-1] if isinstance(s, str) and s] if isinstance(scopes, list) else []
        return modules[-1] if modules else None
    return None


def describe(node) -> str:
    """`'node_Add_12' (in features.2.1)`, or the node name alone."""
    module = module_of(node)
    return f"'{node.name}'" + (f" (in {module})" if module else "")
