"""The executor's plans, decided once from the graph: which values some output needs, which
the loss differentiates, the backward steps (which VJP serves each argument, which values they
read, which parameter-gradient write comes first) and the forward steps (with the values each
releases). ``OpContext`` is what an op's forward may know about the call."""

from __future__ import annotations

from hpc_rlx.base.errors import GraphError
from hpc_rlx.graph.registry import OPS, VJPS, vjp_fn
from hpc_rlx.graph.shapes import FLOAT


class OpContext:
    """What an op's forward may know about the call (dropout needs the seed and its node), and
    where a training forward publishes a buffer's new statistic (``emit``); ``sync`` sums a small
    array over every part of the global batch (model.sync_batch_norm; None: this part alone)."""

    __slots__ = ("train", "seed", "need_saved", "index", "node", "emitted", "dtype", "sync")

    def __init__(self, train, seed, dtype, sync=None):
        self.train, self.seed, self.dtype = train, seed, dtype  # dtype: the compute dtype (constants, casts)
        self.sync = sync
        self.need_saved, self.index, self.node = False, 0, ""
        self.emitted = []  # (node index, argument position, value)

    def emit(self, position: int, value) -> None:
        """Publish ``value`` as this step's statistic for the buffer wired to argument ``position``
        (batch norm's batch mean and variance); the executor writes it into the buffer's slot of
        the gradient vector, scaled like the gradients."""
        self.emitted.append((self.index, position, value))


class Step:
    """One forward op: its node, function, attributes, argument slots, output slot, whether
    backward reads what it saves, and the slots it releases once it ran."""
    __slots__ = ("index", "name", "forward", "attrs", "args", "slot", "need_saved", "release")


class BackStep:
    """One node's VJPs: ``grads`` holds (argument slot, VJP, parameter name or None, first
    write of that parameter); ``done`` the parameters whose gradient is final after it."""
    __slots__ = ("slot", "attrs", "args", "grads", "done")


def live_slots(node_slot, node_args, roots) -> set:
    """The slots the values in ``roots`` depend on (themselves included): only those nodes run."""
    live = set(roots)
    for k in range(len(node_slot) - 1, -1, -1):
        if node_slot[k] in live:
            live.update(node_args[k])
    return live


def differentiable_reach(g, nodes, node_slot, node_args, sources, roots) -> set:
    """The values that get a cotangent: float values that depend on a slot in ``sources`` (the
    trainable parameters, the float boundary inputs) and reach a slot in ``roots`` (the loss,
    the boundary outputs)."""
    requires = set(sources)
    for k, n in enumerate(nodes):
        if g.types[n.name].dtype == FLOAT and any(a in requires for a in node_args[k]):
            requires.add(node_slot[k])
    reached = {s for s in roots if s in requires}
    for k in range(len(nodes) - 1, -1, -1):
        if node_slot[k] in reached:
            reached.update(a for a in node_args[k] if a in requires)
    return reached


def backward_steps(g, nodes, node_slot, node_args, reached, param_of) -> tuple[list, set, set]:
    """(steps, kept, first_write): the VJP steps in reverse order, the slots they read (forward
    keeps them), and the parameter slots some step writes."""
    backward, kept, first_write = [], set(), set()
    for k in range(len(nodes) - 1, -1, -1):
        n, s = nodes[k], node_slot[k]
        if s not in reached:
            continue
        rule = VJPS.get(n.op)
        if rule is None:
            raise GraphError(f"node '{n.name}': op '{n.op}' has no VJP, but the loss is differentiated through it")
        bs = BackStep()
        bs.slot, bs.attrs, bs.args, bs.grads = s, g.norm_attrs[n.name], node_args[k], []
        for pos, a in enumerate(node_args[k]):
            if a not in reached:
                continue
            fn = vjp_fn(n.op, pos)
            if fn is None:
                arg = OPS[n.op].arg_names[pos] if pos < len(OPS[n.op].arg_names) else pos
                raise GraphError(
                    f"node '{n.name}': op '{n.op}' has no VJP for argument {arg!r} ('{n.inputs[pos]}'), "
                    "but the loss is differentiated through it"
                )
            pname = param_of.get(a)
            first = pname is not None and a not in first_write
            if first:
                first_write.add(a)
            bs.grads.append((a, fn, pname, first))
        kept.update(node_args[k][i] for i in rule.needs_args if i < len(node_args[k]))
        if rule.needs_ans:
            kept.add(s)
        backward.append(bs)
    # The last write of each parameter gradient: after that step ``on_grad_ready`` hears of it.
    last = {pname: k for k, bs in enumerate(backward) for _, _, pname, _ in bs.grads if pname is not None}
    for k, bs in enumerate(backward):
        bs.done = [name for name, j in last.items() if j == k]
    return backward, kept, first_write


def forward_steps(g, nodes, node_slot, node_args, live, keep, saving, first_node_slot) -> list:
    """Forward steps; each releases the values no later step (or the backward pass) reads."""
    last_use = {}
    for k, args in enumerate(node_args):
        if node_slot[k] in live:
            for a in args:
                last_use[a] = k
    steps = []
    for k, n in enumerate(nodes):
        if node_slot[k] not in live:
            continue
        st = Step()
        st.index, st.name = g.order[k], n.name
        st.forward, st.attrs = OPS[n.op].forward, g.norm_attrs[n.name]
        st.args, st.slot = node_args[k], node_slot[k]
        st.need_saved = node_slot[k] in saving
        # Inputs and parameters belong to the caller and are never released.
        st.release = [
            a for a in set(node_args[k]) if a >= first_node_slot and last_use.get(a) == k and a not in keep
        ]
        if node_slot[k] not in last_use and node_slot[k] not in keep:
            st.release.append(node_slot[k])
        steps.append(st)
    return steps
