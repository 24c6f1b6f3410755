"""Runs a Graph on NumPy or CuPy: forward, and reverse-mode gradients into caller-owned views.

Everything that can be decided from the graph alone is decided once, in the constructor
(``plan.py``): the execution order, which nodes the loss depends on differentiably, which VJP serves each
argument, which forward values the backward pass will read (the rest are dropped as soon as
their last consumer ran), and which parameter-gradient write comes first (that one goes
straight into the caller's view; later ones accumulate into it).
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.base import backend
from hpc_rlx.base.errors import DataError, DeviceError, GraphError
from hpc_rlx.graph import rewrite as rewrite_mod
from hpc_rlx.graph.ir import Graph
from hpc_rlx.graph.params import ParamLayout
from hpc_rlx.graph.plan import OpContext, backward_steps, differentiable_reach, forward_steps, live_slots
from hpc_rlx.graph.shapes import FLOAT, fmt_shape

_DTYPES = {"float32": np.float32, "float64": np.float64}


class StageRun:
    """One micro-batch's forward through a pipeline stage, kept until its backward:
    ``boundary`` (name -> the array the stage hands on; the executor's own, read-only) and
    ``outputs`` (the last stage's loss and metrics as floats)."""

    __slots__ = ("env", "saved", "ctx", "device", "boundary", "outputs")


class Executor:
    """``Executor(graph, xp=numpy, dtype="float32")``; see ``forward_backward`` and ``evaluate``.
    ``rewrite=False`` runs the graph exactly as written (no ``rewrite.py`` rewrites). A tool that
    walks the training pass itself (``node_timing``) reads ``train_plan``, ``backward_plan``
    (``plan.Step``, ``plan.BackStep``), ``loss_slot`` and ``load_slots``."""

    def __init__(self, graph: Graph, xp=np, dtype="float32", rewrite=True):
        if not isinstance(graph, Graph):
            raise TypeError(f"Executor needs a Graph, got {type(graph).__name__}")
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if name not in _DTYPES:
            raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
        self.graph, self.xp = graph, xp
        self.dtype = np.dtype(_DTYPES[name])
        self.layout = ParamLayout(graph)
        self._array_type = xp.ndarray
        if backend.is_host(xp):
            backend.keep_host_memory()  # steps re-allocate the same buffers: keep them mapped

        # What runs is the graph after exact rewrites (``rewrite.py``); ``self.graph`` stays
        # the caller's. ``run`` of a node a rewrite moved takes the graph as written.
        g, self._moved = rewrite_mod.pool_before_relu(graph) if rewrite else (graph, frozenset())
        self._g, self._plain = g, None
        self._inputs = [(s.name, s.shape, s.dtype) for s in g.inputs]
        self._params = [(p.name, tuple(p.shape)) for p in g.params]
        # the gradient views: every parameter and buffer but the frozen (model.freeze) ones
        self._grad_params = [(p.name, tuple(p.shape)) for p in g.params if not p.frozen]
        self._slot_values(g)
        self._plan_steps(g)

    def _slot_values(self, g: Graph) -> None:
        """Every value gets a slot: the inputs, the parameters, then the nodes in order."""
        slot = {s.name: i for i, s in enumerate(g.inputs)}
        slot.update({p.name: len(g.inputs) + i for i, p in enumerate(g.params)})
        self._first_node_slot = len(slot)
        for k, idx in enumerate(g.order):
            slot[g.nodes[idx].name] = self._first_node_slot + k
        self._nslots = len(slot)
        self._outputs = [(out, slot[ref]) for out, ref in g.outputs.items()]
        self.loss_slot = slot[g.outputs[g.loss_name]] if g.loss_name in g.outputs else None
        # A pipeline stage: values it hands on (seeded with their gradients in backward) and
        # the float values it receives (whose gradients backward returns).
        self._bout = [(name, slot[name]) for name in g.boundary_outputs]
        self._bin = [(name, slot[name]) for name in g.boundary_inputs if g.types[name].dtype == FLOAT]
        self._buffer_slots = [(p.name, slot[p.name]) for p in g.params if not p.trainable]
        buffer_of = {s: name for name, s in self._buffer_slots}
        # (node index, argument position) -> the buffer an emitted statistic updates
        self._emit_target = {(i, pos): buffer_of[slot[r]] for i, n in enumerate(g.nodes)
                             for pos, r in enumerate(n.inputs) if slot[r] in buffer_of}
        self._slot = slot

    def _plan_steps(self, g: Graph) -> None:
        """The backward steps, then the training and evaluation forwards (``plan.py``)."""
        slot = self._slot
        nodes = [g.nodes[i] for i in g.order]  # topological
        node_slot = [slot[n.name] for n in nodes]
        node_args = [[slot[r] for r in n.inputs] for n in nodes]
        # Only nodes some output depends on run at all.
        live = live_slots(node_slot, node_args, [s for _, s in self._outputs + self._bout])
        # a frozen parameter is no source: the VJPs of its argument positions (a weight's
        # gradient products) are never planned, those of the values it meets still are
        param_of = {slot[p.name]: p.name for p in g.params if p.trainable and not p.frozen}
        sources = set(param_of) | {s for _, s in self._bin}
        roots = [self.loss_slot] + [s for _, s in self._bout]
        reached = differentiable_reach(g, nodes, node_slot, node_args, sources, roots)
        backward, kept, first_write = backward_steps(g, nodes, node_slot, node_args, reached, param_of)
        self.backward_plan = backward
        self._unreached_params = [name for s, name in param_of.items() if s not in first_write]
        self.train_plan = self._plan(nodes, node_slot, node_args, live, kept, {b.slot for b in backward})
        self._eval_plan = self._plan(nodes, node_slot, node_args, live, set(), set())

    def _plan(self, nodes, node_slot, node_args, live, kept, saving, outputs=None):
        """Forward steps; each releases the values no later step (or the backward pass) reads."""
        keep = set(kept) | {s for _, s in (self._outputs + self._bout if outputs is None else outputs)}
        return forward_steps(self._g, nodes, node_slot, node_args, live, keep, saving, self._first_node_slot)

    def load_slots(self, feeds, params) -> list:
        """The value slots of one pass: ``feeds`` (checked like a step's) and ``params`` in place,
        every node's value empty; for a tool that walks ``train_plan`` and ``backward_plan`` itself."""
        env = [None] * self._nslots
        self._load(env, feeds, params, None)
        return env

    # ------------------------------------------------------------------ argument checks

    def _device(self, a, what: str, device):
        """The GPU id ``a`` lives on (None on the host); raises if it differs from ``device``."""
        if backend.is_host(self.xp):
            return None
        dev = a.device.id
        if device is not None and dev != device:
            raise DeviceError(f"{what} lives on GPU {dev} but the parameters on GPU {device}; move it explicitly")
        return dev

    def _require_module(self, a, what: str) -> None:
        """No silent host/device mixing: an array of the other array module is refused."""
        if not isinstance(a, self._array_type):
            raise DeviceError(f"{what} is a {type(a).__module__}.{type(a).__name__}, but this executor runs "
                              f"on {self.xp.__name__}; move it explicitly")

    def _check_arrays(self, arrays, what: str, device=None, params=None):
        """Validate a param/grad dict (``params``: the names and shapes it must hold, default
        every parameter); returns the GPU id the arrays live on (None on the host)."""
        if not isinstance(arrays, dict):
            raise TypeError(f"{what} must be a dict of name -> array")
        for name, shape in self._params if params is None else params:
            v = arrays.get(name)
            if v is None:
                raise GraphError(f"{what}: parameter '{name}' is missing")
            self._require_module(v, f"{what}['{name}']")
            if v.dtype != self.dtype or v.shape != shape:
                raise GraphError(
                    f"{what}['{name}'] is {v.dtype} {tuple(v.shape)}, expected {self.dtype} {shape}"
                )
            device = self._device(v, f"{what}['{name}']", device)
        return device

    def _load(self, env, feeds, params, device, needed=None):
        if not isinstance(feeds, dict):
            raise TypeError("feeds must be a dict of input name -> array")
        unknown = sorted(set(feeds) - {n for n, _, _ in self._inputs})
        if unknown:
            raise DataError(f"feeds {unknown} match no graph input (inputs: {[n for n, _, _ in self._inputs]})")
        batch = None
        for i, (name, shape, dtype) in enumerate(self._inputs):
            a = feeds.get(name)
            if a is None and needed is not None and i not in needed:
                continue
            if a is None:
                raise DataError(f"input '{name}' was not fed")
            self._require_module(a, f"input '{name}'")
            if dtype == FLOAT:
                if a.dtype != self.dtype:
                    raise DataError(f"input '{name}' has dtype {a.dtype}, the executor computes in {self.dtype}")
            elif a.dtype.kind not in "iu":
                raise DataError(f"input '{name}' must hold integers, got dtype {a.dtype}")
            ok = a.ndim == len(shape)
            for d, n in zip(shape, a.shape if ok else ()):
                if d is None:
                    if batch is None:
                        batch = n
                    ok = ok and n == batch and n > 0
                else:
                    ok = ok and n == d
            if not ok:
                raise DataError(
                    f"input '{name}' has shape {tuple(a.shape)}, the graph expects {fmt_shape(shape)}"
                    + (f" with batch {batch}" if batch is not None else "")
                )
            device = self._device(a, f"input '{name}'", device)
            env[i] = a
        base = len(self._inputs)
        for j, (name, _) in enumerate(self._params):
            env[base + j] = params[name]
        return device

    # ------------------------------------------------------------------ running

    def _forward(self, plan, env, saved, ctx) -> None:
        xp = self.xp
        for st in plan:
            ctx.index, ctx.node, ctx.need_saved = st.index, st.name, st.need_saved
            out, sv = st.forward(xp, [env[a] for a in st.args], st.attrs, ctx)
            env[st.slot] = out
            if sv is not None:
                saved[st.slot] = sv
            for a in st.release:
                env[a] = None

    def forward_backward(self, param_views, grad_views, feeds, train=True, seed=None, grad_scale=1.0,
                         on_grad_ready=None, accumulate=False, sync=None) -> dict:
        """Overwrite ``grad_views`` with ``grad_scale * d(mean loss)/d(param)`` (add to them with
        ``accumulate``: gradient accumulation's later micro-batches); return the outputs as floats.

        ``train`` enables dropout, whose masks derive from ``seed`` and the node. Feeds, params and
        grads must already live on this executor's array module (and the same GPU).
        ``on_grad_ready(name)``, if given, is called once per parameter and buffer as soon as its
        slot of ``grad_views`` is final (buffers' statistics right after the forward pass, each
        parameter after the last VJP that writes it), on the calling thread, so a caller can
        start reducing finished gradients while backward still runs (``comm.overlap``). ``sync``:
        see ``plan.OpContext`` (every part must run the same graph in step: batch norm calls it in
        forward and backward).
        ``grad_scale`` may be a pair: (the loss's weight, the buffers' statistics' weight).
        """
        if self.loss_slot is None:
            raise GraphError("forward_backward: this graph has no loss (a pipeline stage before the last: "
                             "use stage_forward and stage_backward)")
        device = self._check_arrays(param_views, "param_views")
        device = self._check_arrays(grad_views, "grad_views", device, self._grad_params)
        env = [None] * self._nslots
        device = self._load(env, feeds, param_views, device)
        with backend.use_device(device):
            return self._run_backward(env, grad_views, train, seed, grad_scale, on_grad_ready, accumulate, sync)

    def _run_backward(self, env, grad_views, train, seed, grad_scale, ready=None, accumulate=False, sync=None) -> dict:
        xp = self.xp
        saved = [None] * self._nslots
        ctx = OpContext(bool(train), seed, self.dtype, sync)
        self._forward(self.train_plan, env, saved, ctx)
        results = [(name, env[s]) for name, s in self._outputs]
        grad_scale, stat_scale = grad_scale if isinstance(grad_scale, tuple) else (grad_scale, grad_scale)
        self._write_statistics(env, ctx, grad_views, stat_scale, accumulate)

        cot = [None] * self._nslots
        cot[self.loss_slot] = xp.asarray(grad_scale, dtype=self.dtype)
        self._backward_pass(env, saved, cot, grad_views, ready, accumulate)
        return {name: float(v) for name, v in results}

    def _backward_pass(self, env, saved, cot, grad_views, ready, accumulate) -> None:
        """Run the planned VJPs from the seeded cotangents ``cot``; ``accumulate`` adds to
        ``grad_views`` instead of overwriting them (micro-batches: a pipeline stage's, or
        gradient accumulation's)."""
        xp = self.xp
        if not accumulate:
            for name in self._unreached_params:
                grad_views[name][...] = 0
        if ready is not None:
            for name, _ in self._buffer_slots:
                ready(name)
            for name in self._unreached_params:
                ready(name)
        for bs in self.backward_plan:
            g = cot[bs.slot]
            cot[bs.slot] = None
            args = [env[a] for a in bs.args]
            ans, sv = env[bs.slot], saved[bs.slot]
            for a, fn, pname, first in bs.grads:
                if pname is None:
                    r = fn(xp, g, args, ans, sv, bs.attrs, None)
                    c = cot[a]
                    cot[a] = r if c is None else c + r  # never in place: r or c may alias another value
                elif first and not accumulate:
                    dest = grad_views[pname]
                    r = fn(xp, g, args, ans, sv, bs.attrs, dest)
                    if r is not dest:
                        dest[...] = r
                else:
                    grad_views[pname][...] += fn(xp, g, args, ans, sv, bs.attrs, None)
            # This node's output and saved state are read by no VJP still to come: drop them now.
            env[bs.slot] = saved[bs.slot] = None
            del g, args, ans, sv
            if ready is not None:
                for name in bs.done:
                    ready(name)

    def _write_statistics(self, env, ctx, grad_views, grad_scale, accumulate=False) -> None:
        """Each buffer's slot of the gradient vector gets ``grad_scale`` times this step's
        statistic (its current value when no op emitted one, so the running update leaves it
        be); the runtime's sample-weighted sum then yields the mean statistic over lanes and ranks."""
        if not self._buffer_slots:
            return
        emitted = {self._emit_target[(i, pos)]: v for i, pos, v in ctx.emitted if (i, pos) in self._emit_target}
        for name, s in self._buffer_slots:
            dest = grad_views[name]
            if accumulate:
                dest += emitted.get(name, env[s]) * grad_scale
            else:
                self.xp.multiply(emitted.get(name, env[s]), grad_scale, out=dest)

    # ------------------------------------------------------------------ pipeline stages

    def stage_forward(self, param_views, feeds, train=True, seed=None) -> StageRun:
        """A pipeline stage's training forward (``partition.StageGraph``): ``feeds`` hold the
        graph inputs the stage reads and the boundary values it receives. Keeps what its
        backward reads in the returned ``StageRun`` until ``stage_backward``."""
        device = self._check_arrays(param_views, "param_views")
        env = [None] * self._nslots
        device = self._load(env, feeds, param_views, device)
        run = StageRun()
        run.env, run.saved, run.device = env, [None] * self._nslots, device
        run.ctx = OpContext(bool(train), seed, self.dtype)
        with backend.use_device(device):
            self._forward(self.train_plan, env, run.saved, run.ctx)
        run.outputs = {name: float(env[s]) for name, s in self._outputs}
        run.boundary = {name: env[s] for name, s in self._bout}
        return run

    def stage_backward(self, run: StageRun, grad_views, boundary_grads, grad_scale=1.0, accumulate=True) -> dict:
        """Backward of ``run``, seeded with ``boundary_grads`` (name -> the gradient of each
        float value the stage hands on) and, on the stage holding the loss, ``grad_scale`` on
        the loss. Adds the parameter gradients (and buffers' statistics times ``grad_scale``)
        to ``grad_views`` (overwrites them with ``accumulate=False``). Returns name -> the
        gradient of each float boundary input (zeros where none reaches it); these may be the
        very arrays passed in ``boundary_grads`` (a value carried through unchanged)."""
        if run.env is None:
            raise GraphError("stage_backward: this StageRun's backward already ran")
        self._check_arrays(grad_views, "grad_views", run.device, self._grad_params)
        xp, env, cot = self.xp, run.env, [None] * self._nslots
        if self.loss_slot is not None:
            cot[self.loss_slot] = xp.asarray(grad_scale, dtype=self.dtype)
        for name, s in self._bout:
            if self._g.types[name].dtype != FLOAT:
                continue
            g = boundary_grads.get(name)
            if g is None or g.shape != env[s].shape or g.dtype != self.dtype:
                got = "nothing" if g is None else f"{g.dtype} {tuple(g.shape)}"
                raise GraphError(f"stage_backward: the gradient of '{name}' must be {self.dtype} "
                                 f"{tuple(env[s].shape)}, got {got}")
            cot[s] = g
        with backend.use_device(run.device):
            self._write_statistics(env, run.ctx, grad_views, grad_scale, accumulate)
            self._backward_pass(env, run.saved, cot, grad_views, None, accumulate)
            grads = {name: cot[s] if cot[s] is not None else xp.zeros_like(env[s]) for name, s in self._bin}
        run.env = run.saved = run.ctx = None
        return grads

    def run(self, param_views, feeds, fetch, train=False, seed=None) -> dict:
        """Forward only; returns ``{name: array}`` for the graph nodes named in ``fetch`` (a
        model's output before its loss, say). Only the inputs those nodes depend on need feeding."""
        names = [fetch] if isinstance(fetch, str) else list(fetch)
        if self._moved.intersection(names):
            if self._plain is None:
                self._plain = Executor(self.graph, self.xp, self.dtype.name, rewrite=False)
            return self._plain.run(param_views, feeds, names, train, seed)
        nodes = [self._g.nodes[i] for i in self._g.order]
        for name in names:
            if name not in self._slot or self._slot[name] < self._first_node_slot:
                raise GraphError(f"fetch: {name!r} is not a node of the graph")
        node_slot = [self._slot[n.name] for n in nodes]
        node_args = [[self._slot[r] for r in n.inputs] for n in nodes]
        live = live_slots(node_slot, node_args, [self._slot[n] for n in names])
        plan = self._plan(nodes, node_slot, node_args, live, set(), set(),
                          outputs=[(n, self._slot[n]) for n in names])
        device = self._check_arrays(param_views, "param_views")
        env = [None] * self._nslots
        device = self._load(env, feeds, param_views, device, needed=live)
        with backend.use_device(device):
            self._forward(plan, env, [None] * self._nslots, OpContext(bool(train), seed, self.dtype))
            return {n: env[self._slot[n]] for n in names}

    def forward(self, param_views, feeds, train=False, seed=None) -> dict:
        """Forward pass only; ``train`` enables dropout (then ``seed`` is needed)."""
        device = self._check_arrays(param_views, "param_views")
        env = [None] * self._nslots
        device = self._load(env, feeds, param_views, device)
        with backend.use_device(device):
            self._forward(self._eval_plan, env, [None] * self._nslots, OpContext(bool(train), seed, self.dtype))
            return {name: float(env[s]) for name, s in self._outputs}

    def evaluate(self, param_views, feeds) -> dict:
        """Forward only, no dropout: ``{"loss": mean_loss, <metric>: value, ...}``."""
        return self.forward(param_views, feeds, train=False)
