"""Pipeline stages: a ``Graph`` split into S contiguous stages, each a self-contained graph.

A stage is a contiguous run of the graph's live nodes (those some output depends on) in
topological order. Stage k is a ``StageGraph`` holding:

* inputs: the graph inputs (feeds) its nodes read -- every stage takes these from the batch
  itself, nothing forwards them -- then its *boundary inputs*: the values earlier stages
  produced that stage k or a later stage reads, in the order they were produced. A value read
  two stages later passes through the middle stage unchanged (it is both a boundary input and
  a boundary output there), so residual connections cross any cut;
* parameters: those its nodes read. A parameter read in two stages (tied weights) cannot be
  split: the balanced split never separates its readers, and a cut point that does is an error;
* boundary outputs: the values produced in stages <= k that a later stage reads;
* outputs: the graph's scalar outputs (loss and metrics), on the last stage only; every
  output node lies in the last stage.

Where the cuts go: ``cut_points`` names the nodes after which a stage ends. Without them the
split minimises the heaviest stage, a node weighing the elements of the parameters it is the
first to read plus ``cost[name]`` (a measured time, say, in the same units), and among the
splits that reach that minimum, the elements per sample crossing the cuts (cuts land where
little crosses).

The executor runs a stage with ``stage_forward`` (boundary inputs fed like inputs) and
``stage_backward`` (seeded with the gradients of its boundary outputs; returns those of its
float boundary inputs). Running the stages in order, then backward in reverse order passing
the boundary gradients back, gives the whole graph's loss and parameter gradients.
"""

from __future__ import annotations

from hpc_rlx.base.errors import ConfigError, GraphError
from hpc_rlx.graph.ir import Graph, InputSpec
from hpc_rlx.graph.shapes import known_prod


class StageGraph(Graph):
    """One stage of a split graph; ``meta["stage"]`` says which (``index``, ``stages``) and
    names its ``boundary_inputs`` and ``boundary_outputs``. Only the last stage has a loss."""

    def __init__(self, d: dict):
        stage = d.get("meta", {}).get("stage") if isinstance(d, dict) and isinstance(d.get("meta"), dict) else None
        if not isinstance(stage, dict) or not {"index", "stages", "boundary_inputs", "boundary_outputs"} <= set(stage):
            raise GraphError("stage graph: meta.stage must hold index, stages, boundary_inputs, boundary_outputs")
        self.index, self.stages = int(stage["index"]), int(stage["stages"])
        self.requires_loss = self.index == self.stages - 1
        super().__init__(d)
        self.boundary_inputs = tuple(stage["boundary_inputs"])
        self.boundary_outputs = tuple(stage["boundary_outputs"])
        self.param_seeds = tuple(stage.get("param_seeds") or range(len(self.params)))
        self._results = tuple(stage.get("whole_outputs") or self.outputs)
        self._per_sample = int(stage.get("predictions_per_sample") or 1)
        self._classes = stage.get("num_classes")
        self._vocab = stage.get("token_vocab")
        self._whole_inputs = {i["name"]: InputSpec(i["name"], tuple(i["shape"]), i["dtype"])
                              for i in stage.get("whole_inputs") or []}
        inputs = {s.name for s in self.inputs}
        nodes = {n.name for n in self.nodes}
        for name in self.boundary_inputs:
            if name not in inputs:
                raise GraphError(f"stage graph: boundary input '{name}' is not an input")
        for name in self.boundary_outputs:
            if name not in inputs and name not in nodes:
                raise GraphError(f"stage graph: boundary output '{name}' is neither an input nor a node")

    @property
    def result_names(self) -> tuple:
        return self._results

    @property
    def num_classes(self):
        return self._classes

    @property
    def token_vocab(self):
        return self._vocab

    def input(self, name: str):
        """An input of the whole graph (what the data feeds), whether or not this stage reads it."""
        return self._whole_inputs[name] if name in self._whole_inputs else super().input(name)

    @property
    def predictions_per_sample(self) -> int:
        """The whole graph's (only the last stage has the loss it is read from)."""
        return self._per_sample

    @property
    def feeds(self) -> list:
        """The graph inputs this stage reads from the batch (not from an earlier stage)."""
        return [s.name for s in self.inputs if s.name not in self.boundary_inputs]


def _per_sample(shape) -> int:
    return known_prod([d for d in shape if d is not None])


def _min_max_weight(weights, allowed, stages) -> float:
    """The smallest possible heaviest stage over splits of ``weights`` into ``stages`` runs
    whose inner ends lie in ``allowed`` (a cut after position c)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [inf] * (n + 1)  # best[j]: first j nodes in k stages
    best[0] = 0.0
    for k in range(stages):
        last = k == stages - 1
        nxt = [inf] * (n + 1)
        for j in range(1, n + 1):
            if not last and (j - 1) not in allowed or last and j != n:
                continue
            for i in range(k, j):
                if best[i] < inf:
                    v = max(best[i], prefix[j] - prefix[i])
                    if v < nxt[j]:
                        nxt[j] = v
        best = nxt
    return best[n]


def _balanced_cuts(weights, crossing, allowed, stages) -> list:
    """Cut positions: heaviest stage minimal, then the fewest elements crossing the cuts."""
    n = len(weights)
    limit = _min_max_weight(weights, allowed, stages)
    if limit == float("inf"):
        return None
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    tol = 1e-9 * max(1.0, abs(limit))
    inf = float("inf")
    cost = [inf] * (n + 1)
    cost[0] = 0.0
    back = []
    for k in range(stages):
        last = k == stages - 1
        nxt, arg = [inf] * (n + 1), [None] * (n + 1)
        for j in range(1, n + 1):
            if not last and (j - 1) not in allowed or last and j != n:
                continue
            for i in range(k, j):
                if cost[i] < inf and prefix[j] - prefix[i] <= limit + tol:
                    v = cost[i] + (0 if last else crossing[j - 1])
                    if v < nxt[j]:
                        nxt[j], arg[j] = v, i
        back.append(arg)
        cost = nxt
    cuts, j = [], n
    for k in range(stages - 1, 0, -1):
        j = back[k][j]
        cuts.append(j - 1)
    return sorted(cuts)


def load_graph(d: dict) -> Graph:
    """A graph from its JSON form: a ``StageGraph`` when it is one stage of a split."""
    meta = d.get("meta") if isinstance(d, dict) else None
    return (StageGraph if isinstance(meta, dict) and "stage" in meta else Graph).from_dict(d)


def partition(graph: Graph, stages: int | None = None, cut_points=None, cost=None) -> list:
    """Split ``graph`` into ``stages`` StageGraphs (or one more than ``cut_points`` names)."""
    g = graph
    order = [g.nodes[i] for i in g.order]
    live = set(g.outputs.values())
    for n in reversed(order):
        if n.name in live:
            live.update(n.inputs)
    nodes = [n for n in order if n.name in live]
    pos = {n.name: i for i, n in enumerate(nodes)}
    if cut_points is not None:
        if not isinstance(cut_points, (list, tuple)) or not all(isinstance(c, str) for c in cut_points):
            raise ConfigError(f"cut_points must be a list of node names, got {cut_points!r}")
        if stages is not None and stages != len(cut_points) + 1:
            raise ConfigError(f"{len(cut_points)} cut point(s) make {len(cut_points) + 1} stages, "
                              f"but {stages} stages were asked for")
        stages = len(cut_points) + 1
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"the number of stages must be an integer >= 1, got {stages!r}")
    if stages > len(nodes):
        raise ConfigError(f"{stages} stages need at least {stages} nodes, but the graph "
                          f"'{g.name}' has {len(nodes)} that its outputs depend on")

    # A cut after position c is allowed unless it separates a parameter's readers or leaves an
    # output node (loss, metric) outside the last stage.
    readers: dict[str, list] = {}
    for i, n in enumerate(nodes):
        for r in n.inputs:
            readers.setdefault(r, []).append(i)
    first_output = min(pos[r] for r in g.outputs.values())
    blocked = {}
    for p in g.params:
        at = readers.get(p.name)
        if at:
            for c in range(min(at), max(at)):
                blocked.setdefault(c, p.name)
    cost = dict(cost or {})
    unknown = sorted(set(cost) - set(pos))
    if unknown:
        raise ConfigError(f"stage cost names {unknown[:5]}, which are not nodes the outputs depend on")

    if cut_points is not None:
        cuts = _named_cuts(g, nodes, pos, cut_points, stages, first_output, blocked)
    else:
        cuts = _balanced_split(g, nodes, readers, cost, first_output, blocked, stages)
    return _build(g, nodes, cuts, stages)


def _named_cuts(g: Graph, nodes, pos, cut_points, stages, first_output, blocked) -> list:
    """The positions of the named cut points, each checked: a node, no stage empty, the outputs
    in the last stage, no parameter's readers separated."""
    cuts = []
    for c in cut_points:
        if c not in pos:
            what = "is not a node of the graph" if c not in g.types or c in {s.name for s in g.inputs} \
                or c in {p.name for p in g.params} else "is a node no output depends on"
            raise ConfigError(f"cut point '{c}' {what} '{g.name}'")
        cuts.append(pos[c])
    cuts.sort()
    ends = cuts + [len(nodes) - 1]
    for k in range(stages):
        if k and ends[k] == ends[k - 1]:
            raise ConfigError(f"cut points {list(cut_points)} leave stage {k + 1} of {stages} empty")
    for c in cuts:
        if c >= first_output:
            out = min((r for r in g.outputs.values()), key=pos.get)
            raise ConfigError(f"cut point '{nodes[c].name}' leaves output node '{out}' outside the last stage")
        if c in blocked:
            raise ConfigError(f"cut point '{nodes[c].name}' separates the readers of parameter "
                              f"'{blocked[c]}' (a parameter lives in one stage)")
    return cuts


def _balanced_split(g: Graph, nodes, readers, cost, first_output, blocked, stages) -> list:
    """The allowed cuts that balance the stages' parameters (plus ``cost``) and the values
    crossing each cut (`_balanced_cuts`)."""
    weights, seen = [], set()
    for n in nodes:
        fresh = [r for r in n.inputs if r in g.types and r not in seen and any(p.name == r for p in g.params)]
        seen.update(fresh)
        weights.append(float(sum(known_prod(g.types[r].shape) for r in fresh)) + float(cost.get(n.name, 0.0)))
    last_read = {v: max(at) for v, at in readers.items()}
    crossing, alive = [], 0
    ends_at: dict[int, int] = {}
    for i, n in enumerate(nodes):
        end = last_read.get(n.name, i)
        if end > i:
            size = _per_sample(g.types[n.name].shape)
            alive += size
            ends_at[end] = ends_at.get(end, 0) + size
        alive -= ends_at.pop(i, 0)
        crossing.append(alive)
    allowed = {c for c in range(len(nodes) - 1) if c < first_output and c not in blocked}
    cuts = _balanced_cuts(weights, crossing, allowed, stages)
    if cuts is None:
        raise ConfigError(f"graph '{g.name}' cannot be split into {stages} stages: the outputs and the "
                          "readers of each parameter must stay within one stage")
    return cuts


def _build(g: Graph, nodes, cuts, stages) -> list:
    d = g.to_dict()
    raw = {n["name"]: n for n in d["nodes"]}
    bounds = [0] + [c + 1 for c in cuts] + [len(nodes)]
    last_read: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for r in n.inputs:
            last_read[r] = i
    seeds = {p.name: i for i, p in enumerate(g.params)}
    result, carried = [], []
    for k in range(stages):
        lo, hi = bounds[k], bounds[k + 1]
        part = nodes[lo:hi]
        reads = {r for n in part for r in n.inputs}
        params = [p["name"] for p in d["params"] if p["name"] in reads]
        passing = carried + [n.name for n in part]
        handed = [v for v in passing if last_read.get(v, -1) >= hi]
        inputs = [dict(s) for s in d["inputs"] if s["name"] in reads]
        inputs += [{"name": v, "shape": list(g.types[v].shape), "dtype": g.types[v].dtype} for v in carried]
        sd = {
            "schema_version": d["schema_version"],
            "name": f"{g.name}.stage{k}",
            "inputs": inputs,
            "params": [p for p in d["params"] if p["name"] in params],
            "nodes": [raw[n.name] for n in part],
            "outputs": dict(g.outputs) if k == stages - 1 else {},
            "meta": {"stage": {"index": k, "stages": stages, "boundary_inputs": list(carried),
                               "boundary_outputs": handed, "param_seeds": [seeds[p] for p in params],
                               "whole_outputs": list(g.outputs),
                               "predictions_per_sample": g.predictions_per_sample,
                               "num_classes": g.num_classes, "token_vocab": g.token_vocab,
                               "whole_inputs": d["inputs"]},
                     "source": d["meta"]},
        }
        result.append(StageGraph(sd))
        carried = handed
    return result
