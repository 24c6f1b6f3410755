"""Exact rewrites the ``Executor`` applies to the graph it plans (the caller's ``Graph``, its
JSON and its fingerprint stay as they are).

``pool_before_relu``: ``max_pool2d(relu(x))`` becomes ``relu(max_pool2d(x))`` when nothing else
reads the ReLU. The two are equal element for element (a maximum commutes with a
non-decreasing function, and ``max`` is exact), and so are their gradients, ties included: if
a window's maximum m is positive, the ReLU keeps every value equal to m and maps the others
below it, so both orders route the gradient to the same first maximum; if m <= 0, both give
zero (the ReLU's mask is 0 at every value of the window, or at m). Pooling first runs the
ReLU forward and backward on the pooled values only: a quarter of them after a 2x2 pool.
Only ``relu`` is moved: other monotone activations can map neighbouring values onto one float
(saturation), which would move a tie and its gradient.
"""

from __future__ import annotations

from hpc_rlx.graph.ir import Graph


def pool_before_relu(graph: Graph) -> tuple[Graph, frozenset]:
    """(graph to run, names whose node now holds a different value). The names keep their
    positions in ``graph.nodes`` (per-node seeds stay as they are); the ReLU's name carries
    the pooled, not-yet-rectified values, the pool's name the final ones."""
    by_name = {n.name: n for n in graph.nodes}
    readers: dict[str, int] = {}
    for n in graph.nodes:
        for r in n.inputs:
            readers[r] = readers.get(r, 0) + 1
    for r in list(graph.outputs.values()) + list(graph.boundary_outputs):  # a stage hands these on
        readers[r] = readers.get(r, 0) + 1
    pairs = {}
    for pool in graph.nodes:
        if pool.op != "max_pool2d":
            continue
        relu = by_name.get(pool.inputs[0])
        if relu is not None and relu.op == "relu" and readers.get(relu.name) == 1:
            pairs[relu.name] = pool
    if not pairs:
        return graph, frozenset()
    d = graph.to_dict()
    for k, node in enumerate(d["nodes"]):
        pool = pairs.get(node["name"])
        if pool is not None:  # the ReLU's slot: the pool, on the ReLU's input
            d["nodes"][k] = {**node, "op": "max_pool2d", "attrs": dict(pool.attrs), "shape": list(pool.shape)}
    pooled = {p.name: relu for relu, p in pairs.items()}
    for k, node in enumerate(d["nodes"]):
        relu = pooled.get(node["name"])
        if relu is not None:  # the pool's slot: the ReLU of the pooled values
            d["nodes"][k] = {**node, "op": "relu", "inputs": [relu], "attrs": {}}
    return type(graph)(d), frozenset(pairs)  # a pipeline stage stays one
