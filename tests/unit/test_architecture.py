"""The package's shape: no import cycles, policies behind one interface and one registry,
and a new policy is one file plus one registry line (checked by adding one and training)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.policies.registry import POLICIES

from tests.support.jobs import (MPI_IMPL, PYTHON, REPO, explain, launch_cmd, launch_prefix, mpi_env, read_log,
                                read_metrics, write_small_classification)

PKG = REPO / "hpc_rlx"


# ---------------------------------------------------------------------------------------------
# The import graph, from every import statement (function-level ones included)
# ---------------------------------------------------------------------------------------------

def _modules(pkg: Path) -> dict[str, Path]:
    mods = {}
    for path in pkg.rglob("*.py"):
        parts = path.relative_to(pkg.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _targets(module: str, path: Path, node, mods: dict) -> list[str]:
    """The package modules an import statement reaches: `from pkg import sub` reaches `sub`."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else origin for a in node.names]
    return [n for n in names if n in mods]


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node, mods):
                    # a module importing its own package (or itself) is not a cycle
                    if target != module and not module.startswith(target + "."):
                        edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "c.py").write_text("from pkg.a import x\n")
    (pkg / "d.py").write_text("from . import a\nimport pkg\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_package_has_no_import_cycles():
    assert cycles(import_graph()) == []


# ---------------------------------------------------------------------------------------------
# Policies: one interface, one registry
# ---------------------------------------------------------------------------------------------

def test_no_code_outside_policies_tells_policies_apart_by_name_or_class():
    names = set(POLICIES)
    classes = {cls.__name__ for cls in POLICIES.values()}
    offenders = []
    for path in PKG.rglob("*.py"):
        if (PKG / "policies") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                consts += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                           for e in c.elts if isinstance(e, ast.Constant)]
                if any(c.value in names for c in consts):
                    offenders.append(f"{path.name}:{node.lineno} compares with a policy name")
            if isinstance(node, ast.Name) and node.id in classes:
                offenders.append(f"{path.name}:{node.lineno} names {node.id}")
    assert not offenders, offenders


def test_every_policy_declares_its_keys_and_has_a_config_group():
    from hpc_rlx.policies import validate_policy_config
    for name, cls in POLICIES.items():
        assert cls.name == name
        group = PKG / "configs" / "policy" / f"{name}.yaml"
        assert group.exists(), f"policy={name} has no config group file"
        assert validate_policy_config({"name": name})["name"] == name


TOY_POLICY = '''
"""`policy=toy`: plain synchronous SGD written against the policy interface only."""

from __future__ import annotations

import math

from .base import Loop, Policy, StepResult


class ToyPolicy(Policy):
    name = "toy"
    steps_are_batches = True
    lr_scale = 0.5

    def step(self, loop: Loop) -> StepResult | None:
        worker, bucket = loop.worker, loop.worker.bucket
        s = worker.step_in_epoch
        if s >= worker.steps_per_epoch:
            return None
        xb, yb = worker.batch(worker.epoch * worker.steps_per_epoch + s)
        n, loss_sum, correct, compute = loop.lanes.step(xb, yb, loop.dropout_seed())
        bucket.zero_tail()
        bucket["samples"], bucket["loss_sum"], bucket["correct"] = n, loss_sum, correct
        flags, comm_s = loop.reduce(nonfinite=not math.isfinite(loss_sum))
        total_n = bucket["samples"]
        bucket.payload /= total_n
        worker.apply_gradient(bucket.payload, worker.lr_at(worker.step) * self.lr_scale)
        worker.state.step_taken(s + 1)
        return StepResult(flags, samples=total_n, loss_sum=bucket["loss_sum"], correct=bucket["correct"],
                          rank_samples=n, rank_loss=loss_sum / max(n, 1), compute_s=compute,
                          comm_s=comm_s, wall_s=compute + comm_s)
'''


@pytest.mark.mpi
def test_a_new_policy_is_one_file_and_one_registry_line(tmp_path):
    """In a copy of the package: add `policies/toy.py` and its line in the registry, then train
    with `policy.name=toy` under mpirun; the loss falls as with sync. (A policy with keys of its
    own also gets a Hydra group option, `configs/policy/NAME.yaml`, for `policy=NAME`.)"""
    copy = tmp_path / "src"
    shutil.copytree(PKG, copy / "hpc_rlx", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "hpc_rlx" / "policies" / "toy.py").write_text(textwrap.dedent(TOY_POLICY))
    registry = copy / "hpc_rlx" / "policies" / "registry.py"
    text = registry.read_text()
    anchor = '    "async": AsyncPolicy,\n'
    assert anchor in text
    registry.write_text(text.replace(anchor, anchor + '    "toy": __import__("hpc_rlx.policies.toy", '
                                     'fromlist=["ToyPolicy"]).ToyPolicy,\n'))
    data = write_small_classification(tmp_path / "d.h5", rows=800, seed=3)
    run_dir = tmp_path / "run"
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={data}",
                         "train.epochs=3", "policy.name=toy", "report.plots=false",
                         "report.tensorboard=false", "checkpoint=off"])
    proc = subprocess.run(cmd, cwd=copy, env=mpi_env({"PYTHONPATH": str(copy)}), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert [r["policy"] for r in epochs] == ["toy"] * 3, explain(proc)
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
    # the copy trained, not the package this test imported
    assert not (PKG / "policies" / "toy.py").exists()


SQUARE_OP = '''
"""`square`: x * x, an op added as one file."""

from __future__ import annotations

from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import require_float


def _same(types, attrs):
    require_float(types[0], "input")
    return types[0]


@defop("square", _same, (1, 1))
def square(xp, args, a, ctx):
    return args[0] * args[0], None


defvjp("square", lambda xp, g, args, ans, s, a, out: 2.0 * args[0] * g)
'''


def _copy_package(tmp_path: Path) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(PKG, copy / "hpc_rlx", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _add_line_after(path: Path, anchor: str, line: str) -> None:
    text = path.read_text()
    assert anchor in text, (path, anchor)
    path.write_text(text.replace(anchor, anchor + line, 1))


def _changed_files(copy: Path) -> set[str]:
    """The files of the package copy that are not the package's own: added or changed."""
    mine = copy / "hpc_rlx"
    return {rel.as_posix() for p in mine.rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and not ((PKG / (rel := p.relative_to(mine))).is_file() and (PKG / rel).read_bytes() == p.read_bytes())}


def _train_copy(copy: Path, tmp_path: Path, overrides: list[str], run_name: str = "run"):
    data = write_small_classification(tmp_path / "d.h5", rows=800, seed=3)
    run_dir = tmp_path / run_name
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={data}",
                         "train.epochs=3", "report.plots=false", "report.tensorboard=false",
                         "checkpoint=off", *overrides])
    proc = subprocess.run(cmd, cwd=copy, env=mpi_env({"PYTHONPATH": str(copy)}), capture_output=True,
                          text=True, timeout=240)
    return proc, run_dir


@pytest.mark.mpi
def test_a_new_op_is_one_file_and_one_registry_line(tmp_path):
    """In a copy of the package: `graph/ops/square.py` and its import beside the built-in ops,
    then an MLP graph file whose activations are `square` trains (and the engine's gradient
    check passes on the new op)."""
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "graph" / "ops" / "square.py").write_text(textwrap.dedent(SQUARE_OP))
    anchor = "from hpc_rlx.graph.ops import shape  # noqa: F401\n"
    _add_line_after(copy / "hpc_rlx" / "graph" / "ops" / "__init__.py", anchor,
                    "from hpc_rlx.graph.ops import square  # noqa: F401\n")
    graph = tmp_path / "net.json"
    check = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np; from hpc_rlx.graph import build_model; "
         "from hpc_rlx.graph.gradcheck import check_op; "
         "check_op('square', [np.random.default_rng(0).standard_normal((3, 4))]); "
         "g = build_model('mlp', input_shape=(6,), num_classes=3, hidden=[8]).to_json(); "
         "assert '\"relu\"' in g; open(sys.argv[1], 'w').write(g.replace('\"relu\"', '\"square\"'))",
         str(graph)], cwd=copy, env=mpi_env({"PYTHONPATH": str(copy)}), capture_output=True, text=True,
        timeout=120)
    assert check.returncode == 0, explain(check)
    proc, run_dir = _train_copy(copy, tmp_path, ["model=graph", f"model.path={graph}", "optim.lr=0.02"])
    assert proc.returncode == 0, explain(proc)
    assert '"square"' in (run_dir / "graph.json").read_text()
    epochs = read_metrics(run_dir)
    assert len(epochs) == 3 and epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
    assert not (PKG / "graph" / "ops" / "square.py").exists()


SIGN_SGD = '''
"""`optim=signsgd`: p -= lr * sign(g), an optimizer added as one file."""

from __future__ import annotations

from hpc_rlx.optim.base import NONNEG, Hyper, Optimizer


class SignSGD(Optimizer):
    name = "signsgd"
    lr = 0.001
    hyper = (Hyper("weight_decay", 0.0, "decoupled weight decay", NONNEG),)

    def __init__(self, size, xp, dtype, weight_decay=0.0):
        super().__init__(size, xp, dtype)
        self.weight_decay = float(weight_decay)

    def step(self, params, grads, lr, grad_scale=1.0):
        self._check_args(params, grads)
        if self.weight_decay:
            params *= 1.0 - lr * self.weight_decay
        self.xp.sign(grads, out=grads)
        grads *= lr
        params -= grads
        self.step_count += 1
'''


@pytest.mark.mpi
def test_a_new_optimizer_is_one_file_one_registry_line_and_its_yaml(tmp_path):
    """In a copy of the package: `optim/signsgd.py`, its line in the registry and
    `configs/optim/signsgd.yaml`; then `optim=signsgd` trains, with its declared key on the
    command line (the schema took it from the class)."""
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "optim" / "signsgd.py").write_text(textwrap.dedent(SIGN_SGD))
    _add_line_after(copy / "hpc_rlx" / "optim" / "registry.py", '    "lion": Lion,\n',
                    '    "signsgd": __import__("hpc_rlx.optim.signsgd", fromlist=["SignSGD"]).SignSGD,\n')
    (copy / "hpc_rlx" / "configs" / "optim" / "signsgd.yaml").write_text(
        (PKG / "configs" / "optim" / "lion.yaml").read_text()
        .replace("name: lion", "name: signsgd").replace("betas: [0.9, 0.99]\n", ""))
    proc, run_dir = _train_copy(copy, tmp_path, ["optim=signsgd", "optim.lr=0.003", "optim.weight_decay=0.01"])
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert len(epochs) == 3 and epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
    assert "signsgd" in (run_dir / "config.yaml").read_text()
    assert not (PKG / "optim" / "signsgd.py").exists()


STEP_TIME_METRIC = '''
"""`step_ms`: milliseconds per step, a metric added as one file."""

from __future__ import annotations

from hpc_rlx.observe.metrics.base import Metric, Window


class StepTime(Metric):
    step_key = epoch_key = "step_ms"
    label = "ms/step"

    def value(self, window: Window) -> float | None:
        return 1e3 * window["step_wall_s"] / window["steps"] if window["steps"] else None
'''


@pytest.mark.mpi
def test_a_new_metric_is_one_file_and_one_registry_line(tmp_path):
    """In a copy of the package: `observe/metrics/step_time.py` and its line in the registry;
    the metric then reaches metrics.jsonl, steps.jsonl, TensorBoard and the progress line."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="the tensorboard package reads the event files")
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "observe" / "metrics" / "step_time.py").write_text(textwrap.dedent(STEP_TIME_METRIC))
    _add_line_after(copy / "hpc_rlx" / "observe" / "metrics" / "registry.py", "    SamplesPerSecond(),\n",
                    '    __import__("hpc_rlx.observe.metrics.step_time", fromlist=["StepTime"]).StepTime(),\n')
    proc, run_dir = _train_copy(copy, tmp_path, ["report.tensorboard=true", "train.progress=lines",
                                                 "train.log_every_s=0"])
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert len(epochs) == 3 and all(r["step_ms"] > 0 for r in epochs), epochs
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps and all(r["step_ms"] > 0 for r in steps), steps
    board = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    assert {"train/step_ms", "epoch/step_ms"} <= set(board.Tags()["scalars"]), board.Tags()
    assert [e.value for e in board.Scalars("epoch/step_ms")] == pytest.approx([r["step_ms"] for r in epochs])
    progress = [line for line in proc.stdout.splitlines() if "% (step " in line]
    assert progress and all(re.search(r"  ms/step [0-9.]+  ", line) for line in progress), proc.stdout[-3000:]
    assert not (PKG / "observe" / "metrics" / "step_time.py").exists()


@pytest.mark.mpi
def test_a_new_config_key_is_one_schema_line_and_its_yaml_default(tmp_path):
    """In a copy of the package: one `Key(...)` line in config/schema.py and the key in
    config.yaml; the run accepts and records it, and the schema's check refuses a bad value."""
    copy = _copy_package(tmp_path)
    _add_line_after(copy / "hpc_rlx" / "config" / "schema.py",
                    'Key("train.seed", int, 0, "init, shuffling and dropout seed", integer(0)),\n',
                    '    Key("train.toy_limit", int, 3, "a key added in one line", integer(1)),\n')
    _add_line_after(copy / "hpc_rlx" / "configs" / "config.yaml", "train:\n", "  toy_limit: 3\n")
    proc, run_dir = _train_copy(copy, tmp_path, ["train.toy_limit=5"])
    assert proc.returncode == 0, explain(proc)
    assert "toy_limit: 5" in (run_dir / "config.yaml").read_text()
    bad, _ = _train_copy(copy, tmp_path, ["train.toy_limit=0", "hydra.run.dir=" + str(tmp_path / "bad")])
    assert bad.returncode == 2 and "train.toy_limit" in bad.stderr, explain(bad)


# ---------------------------------------------------------------------------------------------
# Fault tolerance is one package; a part that survives a dead rank is one method
# ---------------------------------------------------------------------------------------------

# The one home of what `comm.on_failure` means and of what it cannot run with
# (hpc_rlx/resilience/), and the schema that declares the key and its choices
ON_FAILURE_READERS = ("resilience/", "config/schema.py")


def _reads_on_failure(node) -> bool:
    """`x["on_failure"]`, `x.get("on_failure", ...)`, `getattr(x, "on_failure")`, `x.on_failure`,
    `dict(x, on_failure=...)`, the key's name as any string, a reader of its own (`def
    on_failure_of`); or a comparison with one of its values that only a mode test would make."""
    if isinstance(node, ast.Constant):
        return node.value == "on_failure"
    if isinstance(node, ast.keyword):
        return node.arg == "on_failure"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "on_failure"
    if isinstance(node, ast.Call) and node.args:
        name = ast.unparse(node.func)
        key = node.args[1] if name == "getattr" and len(node.args) > 1 else node.args[0]
        return (name == "getattr" or name.endswith(".get")) and getattr(key, "value", None) == "on_failure"
    if isinstance(node, ast.Attribute):
        return "on_failure" in node.attr
    if isinstance(node, ast.FunctionDef):
        return "on_failure" in node.name
    if isinstance(node, ast.Compare):
        consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
        return any(c.value in ("shrink", "spare") for c in consts)
    return False


def on_failure_reads(pkg: Path = PKG) -> list[str]:
    """`file:line code` for each read of `comm.on_failure` outside ON_FAILURE_READERS."""
    offenders = []
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        if rel.startswith(ON_FAILURE_READERS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _reads_on_failure(node):
                offenders.append(f"{rel}:{getattr(node, 'lineno', '?')} {ast.unparse(node).splitlines()[0]}")
    return offenders


def test_the_on_failure_finder_finds_each_way_of_reading_it(tmp_path):
    for text in ('c["on_failure"]', 'c.get("on_failure", "abort")', 'getattr(c, "on_failure")',
                 "c.on_failure", 'mode == "spare"', 'dict(c, on_failure="shrink")', 'key = "on_failure"',
                 "def on_failure_of(c): pass"):
        assert any(_reads_on_failure(n) for n in ast.walk(ast.parse(text))), text
    for text in ('c.get("spares")', '"comm.on_failure=abort: ..."', "# on_failure"):
        assert not any(_reads_on_failure(n) for n in ast.walk(ast.parse(text))), text
    # where it may be read: the resilience package and the schema, not the rest of config/
    for rel in ("resilience/mode.py", "config/schema.py", "config/batch_norm_sync.py", "runtime/worker.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text('def mode(c):\n    return c["comm"].get("on_failure", "abort")\n')
    assert sorted(on_failure_reads(tmp_path)) == [
        'config/batch_norm_sync.py:2 \'on_failure\'', 'config/batch_norm_sync.py:2 c[\'comm\'].get(\'on_failure\', \'abort\')',
        'runtime/worker.py:2 \'on_failure\'', 'runtime/worker.py:2 c[\'comm\'].get(\'on_failure\', \'abort\')']


def test_comm_on_failure_is_read_only_by_the_resilience_package_and_the_schema():
    """What the mode means (`resilience.mode.FailureMode`) and what it cannot run with
    (`resilience.mode.check_on_failure`, which `config.spec.build_spec` runs as it is handed
    it) are the resilience package's; the schema declares the key. Other parts offer a hook
    (`resilience.hooks`) and never test the mode themselves."""
    assert on_failure_reads() == []


FAILURE_FIELDS = ("step", "before_training", "abandon")


def test_a_failure_travels_typed_not_as_attributes_on_the_exception():
    """`train` raises `resilience.failure.RunFailed` with its `RunFailure`; nothing sticks the
    step, whether training had begun, or the way out on a caught exception, or reads one back."""
    offenders = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        caught = {h.name for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.name}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in caught and node.attr in FAILURE_FIELDS:
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {ast.unparse(node)} =")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) > 1 \
                    and getattr(node.args[1], "value", None) in FAILURE_FIELDS:
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_the_run_and_the_job_each_read_in_under_80_lines():
    """`Run.execute` set-up, epochs, end; `run_job` ship, train, one error: each under 80 lines."""
    lengths = {}
    for rel, name in (("runtime/train.py", "execute"), ("runtime/train.py", "_set_up"), ("__main__.py", "run_job")):
        for node in ast.walk(ast.parse((PKG / rel).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == name:
                lengths[name] = node.end_lineno - node.lineno + 1
    assert len(lengths) == 3 and max(lengths.values()) < 80, lengths


# The parts of the run's context that hold state shaped by the ranks, rebuilt in place after a
# dead rank; the recovery may call `rebuild` on them and nothing else (it reads what they
# declare: `Policy.own_optimizer_state`, `name`)
RANK_SHAPED_PARTS = ("worker", "policy", "lanes", "checkpoints")


def recovery_calls(pkg: Path = PKG) -> set[str]:
    """`file:line call` for each method other than `rebuild` that `resilience/` calls on a part
    in RANK_SHAPED_PARTS (`policy.roll_back(worker)`, `self.checkpoints.take_over()`; a config
    section's `policy.get(...)` is not a part's)."""
    found = set()
    for path in (pkg / "resilience").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr not in ("rebuild", "get") \
                    and ast.unparse(node.func.value).split(".")[-1] in RANK_SHAPED_PARTS:
                found.add(f"{path.relative_to(pkg).as_posix()}:{node.lineno} {ast.unparse(node.func)}")
    return found


def test_the_recovery_call_finder_finds_a_second_hook(tmp_path):
    (tmp_path / "resilience").mkdir()
    (tmp_path / "resilience" / "in_run.py").write_text(
        "def recover(self, policy, parts):\n    policy.roll_back(self.worker)\n    self.checkpoints.take_over()\n"
        "    for part in parts:\n        part.rebuild(None)\n    self.policy.rebuild(None)\n"
        "    self.worker.bucket.abandon_node_memory()\n    return policy.own_optimizer_state\n")
    assert recovery_calls(tmp_path) == {"resilience/in_run.py:2 policy.roll_back",
                                        "resilience/in_run.py:3 self.checkpoints.take_over"}


def test_a_part_that_survives_a_dead_rank_has_one_hook():
    """`resilience.hooks.RankLossHook` is the one protocol a part of the run offers the
    recovery, with one method, `rebuild(survivors)`; the policy and the checkpoints offer it
    like the worker (a windowed policy's restore point is what it marks at each sync,
    `Loop.restore_point`, which the recovery goes back to), and the recovery calls them
    nothing else."""
    tree = ast.parse((PKG / "resilience" / "hooks.py").read_text())
    protocols = {c.name: [f.name for f in c.body if isinstance(f, ast.FunctionDef)]
                 for c in tree.body if isinstance(c, ast.ClassDef) and "Protocol" in map(ast.unparse, c.bases)}
    assert protocols == {"RankLossHook": ["rebuild"]}, protocols
    from hpc_rlx.checkpoint.runtime import RuntimeCheckpoints
    from hpc_rlx.policies.base import Policy
    from hpc_rlx.resilience.hooks import RankLossHook
    from hpc_rlx.runtime.worker import Worker
    assert all(issubclass(cls, RankLossHook) for cls in (Worker, RuntimeCheckpoints, *POLICIES.values(), Policy))
    assert recovery_calls() == set()


REBUILT_DISPLAY = '''
    def rebuild(self, survivors) -> None:
        """After a dead rank: go on over the survivors (here: say so)."""
        self.log(f"display rebuilt: {survivors.comm.size} ranks, {survivors.training} train")

'''


@pytest.mark.mpi
@pytest.mark.openmpi
@pytest.mark.skipif(MPI_IMPL != "openmpi", reason="a dead rank survived: Open MPI 5's mpirun --with-ft ulfm")
def test_a_part_that_survives_a_dead_rank_is_one_method(tmp_path):
    """In a copy of the package: one method, `rebuild(survivors)`, on a part of the run's
    context (the progress display, observe/display.py): one file changed, no registration. A
    job of 3 ranks that loses rank 2 at step 5 (comm.on_failure=shrink) calls it once on each
    survivor and trains to the end."""
    copy = _copy_package(tmp_path)
    _add_line_after(copy / "hpc_rlx" / "observe" / "display.py", "class RunDisplay:\n",
                    textwrap.indent(textwrap.dedent(REBUILT_DISPLAY), "    "))
    data = write_small_classification(tmp_path / "d.h5", rows=480, seed=0)
    run_dir = tmp_path / "run"
    prefix = launch_prefix(3)
    cmd = prefix[:1] + ["--with-ft", "ulfm"] + prefix[1:] + [
        PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={data}", "train.epochs=2",
        "train.batch_size=24", "model.hidden=[8]", "report.plots=false", "report.tensorboard=false",
        "comm.shared_memory=false", "comm.on_failure=shrink", "debug.fail_rank=2", "debug.fail_point=step",
        "debug.fail_step=5", "debug.fail_mode=kill"]
    proc = subprocess.run(cmd, cwd=copy, env=mpi_env({"PYTHONPATH": str(copy)}), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, explain(proc)
    log = read_log(run_dir)
    assert log.count("display rebuilt: 2 ranks, 2 train") == 1, log
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert not hasattr(__import__("hpc_rlx.observe.display", fromlist=["RunDisplay"]).RunDisplay, "rebuild")


# ---------------------------------------------------------------------------------------------
# Error phases come from markers, not from function names
# ---------------------------------------------------------------------------------------------

def test_the_innermost_phase_names_the_failure():
    from hpc_rlx.base.errors import DataError, phase, phase_of

    def any_name_at_all():
        with phase("a training step"):
            with phase("checkpointing"):
                raise DataError("disk full")

    with pytest.raises(DataError) as info:
        any_name_at_all()
    assert phase_of(info.value, "startup") == "checkpointing"
    assert phase_of(ValueError("outside any phase"), "startup") == "startup"


def test_no_phase_is_looked_up_by_function_name():
    main = (PKG / "__main__.py").read_text()
    assert "extract_tb" not in main and "_PHASES" not in main


# ---------------------------------------------------------------------------------------------
# Module size
# ---------------------------------------------------------------------------------------------

MAX_MODULE_LINES = 450


def test_no_module_is_over_the_size_limit():
    """A module past this has two concerns in it: split it along them."""
    too_long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not too_long, too_long


# ---------------------------------------------------------------------------------------------
# Reduction paths declare what they can do
# ---------------------------------------------------------------------------------------------

def test_no_code_tells_reduction_paths_apart_by_class():
    """The bucket asks a path what it can do (`ReductionPath.overlappable`, `in_node_memory`,
    `exact`); an `isinstance` or `type(...) is` on a path class would hide a capability that a
    new path then lacks."""
    from hpc_rlx.comm import node_memory, reduce
    paths = {name for module in (reduce, node_memory) for name, obj in vars(module).items()
             if isinstance(obj, type) and issubclass(obj, reduce.ReductionPath)}
    assert {"HostSum", "WireSum", "NodeSharedSum", "ReductionPath"} <= paths
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
                named = [n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)]
            elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) \
                    and ast.unparse(node.left.func) == "type":
                named = [n.id for c in node.comparators for n in ast.walk(c) if isinstance(n, ast.Name)]
            offenders += [f"{path.relative_to(PKG)}:{node.lineno} {name}" for name in named if name in paths]
    assert not offenders, offenders


def test_no_code_finds_what_a_path_can_do_with_hasattr():
    """A path's capabilities are declared (`ReductionPath.keeps_state_by_index`, ...); a
    `hasattr` on a path would miss a new path that declares it."""
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "hasattr" and node.args:
                subject = ast.unparse(node.args[0])
                if "path" in subject or "reduction" in subject:
                    offenders.append(f"{path.relative_to(PKG)}:{node.lineno} hasattr({subject}, ...)")
    assert not offenders, offenders


def test_only_the_bucket_reads_its_reduction_path():
    """The bucket's users call the bucket (`FusedBucket.gather_params`, `exact_reduction`,
    `allreduce`), which asks its path; none reaches into `bucket.reduction` to pick a route."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.relative_to(PKG).parts[0] == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "reduction" \
                    and ast.unparse(node.value).split(".")[-1].endswith("bucket"):
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def getattr_forwarders(pkg: Path = PKG) -> set[str]:
    """`file:Class` for each class in comm/ that defines `__getattr__` or `__getattribute__`:
    names answered by another object (the bucket's memory, its settings) that no one declared."""
    found = set()
    for path in (pkg / "comm").glob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if isinstance(cls, ast.ClassDef) and any(isinstance(f, ast.FunctionDef) and f.name in (
                    "__getattr__", "__getattribute__") for f in cls.body):
                found.add(f"{path.relative_to(pkg).as_posix()}:{cls.name}")
    return found


def test_the_forwarder_finder_finds_getattr(tmp_path):
    (tmp_path / "comm").mkdir()
    (tmp_path / "comm" / "a.py").write_text("class Hub:\n    def __getattr__(self, name):\n"
                                            "        return getattr(self.memory, name)\n"
                                            "class Plain:\n    def get(self, name):\n        return name\n")
    assert getattr_forwarders(tmp_path) == {"comm/a.py:Hub"}


def test_the_bucket_forwards_no_names_it_does_not_declare():
    """`FusedBucket` declares what its users read (the layout, the host arrays, the named
    fields, `communicators`); its memory's device twin and transfers and its settings are read
    where they live (`bucket.memory`, `bucket.settings`), so what the bucket offers is written
    in one place."""
    assert getattr_forwarders() == set()


def _bucket_and_path_members() -> set[str]:
    from hpc_rlx.comm.collective import FusedBucket
    from hpc_rlx.comm.reduce import ReductionPath
    bucket = FusedBucket(4, ("samples",), np.float64)
    return {n for obj in (bucket, ReductionPath) for n in dir(obj) if not n.startswith("_")} | \
        {"memory", "settings", "reduction"}


def _literal_probe(node: ast.AST) -> tuple[str, object]:
    """(the object, lower-cased, and the member name) of `getattr(x, "name", ...)` or
    `hasattr(x, "name")` with a literal name; ("", None) for any other node."""
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr") \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
        return ast.unparse(node.args[0]).lower(), node.args[1].value
    return "", None


def bucket_probes(pkg: Path = PKG, members: set[str] | None = None) -> set[str]:
    """`file:line call` for each `getattr(x, "name", ...)` / `hasattr(x, "name")` in resilience/
    that asks the bucket or its reduction path for a member by name: `x` names a bucket, a path
    or a reduction, or `name` is one of theirs (what they offer is declared: ask it)."""
    members = _bucket_and_path_members() if members is None else members
    found = set()
    for path in (pkg / "resilience").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            subject, name = _literal_probe(node)
            if any(w in subject for w in ("bucket", "path", "reduction")) or name in members:
                found.add(f"{path.relative_to(pkg).as_posix()}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_bucket_probe_finder_finds_a_probe(tmp_path):
    (tmp_path / "resilience").mkdir()
    (tmp_path / "resilience" / "in_run.py").write_text(
        "def others(self, MPI, x):\n    path = getattr(self.worker.bucket, 'reduction', None)\n"
        "    found = getattr(x, 'communicators', ())\n    pending = getattr(MPI, 'ERR_PROC_FAILED_PENDING', None)\n"
        "    return self.worker.bucket.communicators, getattr(x, 'name_of_its_own', None)\n")
    assert bucket_probes(tmp_path, {"communicators", "reduction"}) == {
        "resilience/in_run.py:2 getattr(self.worker.bucket, 'reduction', None)",
        "resilience/in_run.py:3 getattr(x, 'communicators', ())"}


def test_the_resilience_package_asks_the_bucket_what_it_declares():
    """Where a dead rank may show first is the bucket's declared `communicators` (its path's),
    not a `getattr` probe that a renamed member would silently turn into `()`."""
    assert "communicators" in _bucket_and_path_members()
    assert bucket_probes() == set()


def test_no_module_probes_a_bucket_for_a_member_by_name():
    """Anywhere in the package: `getattr(bucket, "shard", None)` on a bucket that no longer
    forwards `shard` reads None silently (a pipeline stage's start-up line lost its
    reduce-scatter that way); a bucket's members are declared, so they are read, not probed."""
    found = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if "bucket" in _literal_probe(node)[0]:
                found.append(f"{path.relative_to(PKG).as_posix()}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


# ---------------------------------------------------------------------------------------------
# A run directory's file names have one home
# ---------------------------------------------------------------------------------------------

def test_run_directory_file_names_are_spelled_only_in_run_dir_names():
    """Writers and readers name a run directory's files through `hpc_rlx/base/run_dir_names.py`, so
    a renamed file cannot leave a reader behind. (`plots` and `tensorboard` are also config
    keys, so only the names that are nothing else are held here.)"""
    from hpc_rlx.base import run_dir_names as names
    spelled = {getattr(names, n) for n in dir(names) if n.isupper()} - {names.PLOTS, names.TENSORBOARD}
    assert {"metrics.jsonl", "summary.json", "model.h5", "checkpoints"} <= spelled
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "run_dir_names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in spelled:
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------
# The training position has one writer
# ---------------------------------------------------------------------------------------------

POSITION = {"step", "epoch", "step_in_epoch", "skipped_steps", "consecutive_skips"}


def test_only_the_train_state_writes_the_position():
    """Policies, the loop and resume advance it through TrainState's methods; nothing assigns
    a worker's step, epoch or position directly (they are read-only views)."""
    offenders = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr in POSITION and \
                            "worker" in ast.unparse(el.value) + ("worker" if path.name == "worker.py" else ""):
                        offenders.append(f"{path.name}:{node.lineno} {ast.unparse(el)}")
    assert not offenders, offenders


def test_the_train_state_round_trips_through_a_checkpoint_meta():
    from hpc_rlx.base.errors import CheckpointError
    from hpc_rlx.runtime.state import TrainState

    s = TrainState()
    s.step_taken(1)
    s.step_taken(2)
    s.step_skipped()
    s.epoch_ended()
    s.step_taken()
    assert (s.epoch, s.step, s.step_in_epoch, s.skipped_steps) == (1, 3, 1, 1)
    t = TrainState()
    t.restore(s.checkpoint_meta(), steps_per_epoch=5, where="ckpt")
    assert t.checkpoint_meta() == s.checkpoint_meta() and t.consecutive_skips == 0
    with pytest.raises(CheckpointError, match="at step 1 of an epoch that now has 0 steps"):
        TrainState().restore(s.checkpoint_meta(), steps_per_epoch=0, where="ckpt")


# ---------------------------------------------------------------------------------------------
# Imports at the top, unless there is a reason
# ---------------------------------------------------------------------------------------------

# The only modules imported inside functions, and why. `__main__.py` is exempt: it installs
# signal handling before MPI starts and keeps `--help` and completion fast.
LAZY_IMPORTS = {
    "mpi4py": "importing mpi4py.MPI starts MPI: only when a communicator is needed",
    "cupy": "optional GPU backend, imported only in base/backend",
    "cupyx": "ships with CuPy, reached only with a CuPy array in hand",
    "matplotlib": "optional (report extra): plots load it on first use",
    "tqdm": "the progress bar's library, loaded when a bar is drawn",
    "tensorboardX": "optional: loaded when report.tensorboard is on",
    "sklearn": "only to prepare the demo digits file",
    "pydoc_data": "only to prepare the demo text file",
    "numpy": "doctor: loads the BLAS before threadpoolctl looks",
    "onnx": "optional (onnx extra): only rank 0 of a model=onnx run and the exporter read ONNX",
    "onnxruntime": "optional: the exporter's check of the file it wrote",
    "scipy": "erf for exact GELU on NumPy, loaded by the first erf; optim/blas falls back to scipy.linalg",
    # only rank 0 composes the config (runtime/job_channel.py): the other ranks must not pay for
    # Hydra, OmegaConf or YAML in modules they import
    "hydra": "rank 0 alone composes; config/rundirs composes a Slurm job's config on rank 0",
    "omegaconf": "rank 0 alone reads the config's YAML (data/resolve, config/rundirs)",
    "yaml": "rank 0 alone reads config text: the log header (observe/display), segments (config/segments)",
}


def test_imports_inside_functions_are_only_the_lazy_ones():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    roots = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    roots = ["." if node.level else (node.module or "").split(".")[0]]
                else:
                    continue
                for root in roots:
                    if root not in LAZY_IMPORTS:
                        offenders.append(f"{path.relative_to(PKG)}:{node.lineno} imports {root}")
    assert not offenders, offenders


# What a following rank loads: everything a rank other than 0 imports to train, and nothing of
# Hydra, OmegaConf or YAML (only rank 0 composes; see runtime/job_channel.py)
FOLLOWER_MODULES = ("hpc_rlx.__main__", "hpc_rlx.runtime.job_channel", "hpc_rlx.config.spec",
                    "hpc_rlx.runtime.train", "hpc_rlx.injection", "hpc_rlx.comm.collective")


def test_a_following_rank_imports_no_hydra_omegaconf_or_yaml():
    probe = ("import sys\n"
             f"for m in {FOLLOWER_MODULES!r}: __import__(m)\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'yaml'}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, explain(out)
    assert out.stdout.strip() == "[]", explain(out)


# ---------------------------------------------------------------------------------------------
# Layers: a package imports from its own layer or lower ones
# ---------------------------------------------------------------------------------------------

# Low to high, one layer per folder, no exemptions. `base` holds what every layer uses (errors,
# value checks, run-directory names, array backends, CUDA-aware MPI detection, trace spans,
# topology, even ranges) and imports nothing else of hpc_rlx; the root package is the top.
LAYERS = ["base", "device", "injection", "graph", "optim", "comm", "data", "pipeline", "policies", "checkpoint",
          "config", "observe", "resilience", "runtime", "report", "export", "rundirs", "doctor", "__main__"]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__main__"


def _package_imports() -> dict[tuple[str, str], list[str]]:
    """(importing layer, imported layer) -> the module imports behind it, between layers only."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for module, targets in import_graph().items():
        for target in targets:
            if _layer(module) != _layer(target):
                pairs.setdefault((_layer(module), _layer(target)), []).append(f"{module} -> {target}")
    return pairs


def test_every_package_has_its_layer():
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    assert packages | modules <= set(LAYERS), sorted((packages | modules) - set(LAYERS))


def test_layers_import_downward_only():
    offenders = [edge for (low, high), edges in _package_imports().items()
                 if LAYERS.index(high) > LAYERS.index(low) for edge in edges]
    assert not offenders, offenders


def test_base_imports_no_other_package_and_no_two_packages_import_each_other():
    pairs = _package_imports()
    assert not [edges for (low, _), edges in pairs.items() if low == "base"]
    mutual = sorted({tuple(sorted(p)) for p in pairs if p[::-1] in pairs})
    assert not mutual, [(p, pairs[p][:2], pairs[p[::-1]][:2]) for p in mutual]


# ---------------------------------------------------------------------------------------------
# A new reduction path is one file and one registry line
# ---------------------------------------------------------------------------------------------

FLOAT64_SUM = '''
"""`comm.reduction=float64`: each chunk widened to float64, summed by one MPI Allreduce, cast back."""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.reduce import ChunkedSum


class Float64Sum(ChunkedSum):
    name = "float64"

    def sum_chunk(self, comm, part) -> None:
        from mpi4py import MPI
        wide = part.astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
        part[...] = wide
'''


@pytest.mark.mpi
def test_a_new_reduction_path_is_one_file_and_one_registry_line(tmp_path):
    """In a copy of the package: `comm/float64_sum.py` and its line in `comm/registry.py`; then
    `comm.reduction=float64` trains with it (the start-up line names it), and the registry's
    check of what the path declares refuses it where it cannot serve (it is not ordered)."""
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "comm" / "float64_sum.py").write_text(textwrap.dedent(FLOAT64_SUM))
    _add_line_after(copy / "hpc_rlx" / "comm" / "registry.py", '    "wire": WireSum,\n',
                    '    "float64": __import__("hpc_rlx.comm.float64_sum", fromlist=["Float64Sum"]).Float64Sum,\n')
    proc, run_dir = _train_copy(copy, tmp_path, ["comm.reduction=float64"])
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert len(epochs) == 3 and epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
    assert "reduction float64" in proc.stdout, explain(proc)
    assert "reduction float64" in (run_dir / "hpc_rlx.log").read_text()
    assert "reduction: float64" in (run_dir / "config.yaml").read_text()
    bad, _ = _train_copy(copy, tmp_path, ["comm.reduction=float64", "comm.deterministic=true",
                                          "hydra.run.dir=" + str(tmp_path / "bad")])
    assert bad.returncode == 2, explain(bad)
    assert "comm.reduction=float64 does not add in a fixed order" in bad.stderr, explain(bad)
    assert bad.stderr.count("hpc_rlx: error") == 1, explain(bad)
    assert not (PKG / "comm" / "float64_sum.py").exists()


BCAST_GATHER = '''
"""`comm.reduction=bcast_gather` (with `comm.shard=optimizer`): the sharded step's reduce-scatter,
then the parameters gathered by one Bcast from each slice's owner instead of Allgather rounds."""

from __future__ import annotations

from hpc_rlx.comm.shard import ScatteredSum


class BcastGather(ScatteredSum):
    name = "bcast_gather"
    said = False

    def gather_params(self, comm, params) -> int:
        for owner, (lo, hi) in enumerate(self.shard.bounds):
            comm.Bcast(params[lo:hi], root=owner)
        if comm.rank == 0 and not self.said:        # once, so a test sees that it ran
            print("parameters gathered by a Bcast per owner", flush=True)
            self.said = True
        lo, hi = self.shard.bounds[comm.rank]
        return (hi - lo) * params.itemsize * (comm.size - 1)
'''


@pytest.mark.mpi
def test_a_reduction_path_that_gathers_parameters_its_own_way_is_one_file_and_one_line(tmp_path):
    """In a copy of the package: `comm/bcast_gather.py`, a sharded step's path that gathers the
    parameters its own way (`ReductionPath.gathers_params`, `gather_params`), and its line in
    `comm/registry.py`; nothing else changes (the worker calls the bucket's `gather_params`).
    `comm.shard=optimizer comm.reduction=bcast_gather` trains with it, names it at start-up and
    ends with the parameters of the built-in reduce-scatter and allgather, bitwise; without
    `comm.shard=optimizer` the registry refuses it."""
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "comm" / "bcast_gather.py").write_text(textwrap.dedent(BCAST_GATHER))
    _add_line_after(copy / "hpc_rlx" / "comm" / "registry.py", '    "wire": WireSum,\n',
                    '    "bcast_gather": __import__("hpc_rlx.comm.bcast_gather", fromlist=["BcastGather"]).BcastGather,\n')
    assert _changed_files(copy) == {"comm/bcast_gather.py", "comm/registry.py"}
    proc, run_dir = _train_copy(copy, tmp_path, ["comm.shard=optimizer", "comm.reduction=bcast_gather"])
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert len(epochs) == 3 and epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
    assert "reduction bcast_gather, reduce-scatter (comm.shard=optimizer)" in proc.stdout, explain(proc)
    assert proc.stdout.count("parameters gathered by a Bcast per owner") == 1, explain(proc)
    builtin, builtin_dir = _train_copy(copy, tmp_path, ["comm.shard=optimizer"], run_name="builtin")
    assert builtin.returncode == 0, explain(builtin)
    assert "parameters gathered by a Bcast per owner" not in builtin.stdout, explain(builtin)
    with h5py.File(run_dir / "model.h5", "r") as mine, h5py.File(builtin_dir / "model.h5", "r") as theirs:
        assert sorted(mine) == sorted(theirs) and len(mine) > 0
        for name in mine:
            assert np.array_equal(mine[name][...], theirs[name][...]), name
    bad, _ = _train_copy(copy, tmp_path, ["comm.reduction=bcast_gather"], run_name="bad")
    assert bad.returncode == 2, explain(bad)
    assert "comm.reduction=bcast_gather sums a sharded optimizer's slices, which needs comm.shard=optimizer" \
        in bad.stderr, explain(bad)
    assert _changed_files(copy) == {"comm/bcast_gather.py", "comm/registry.py"}
    assert not (PKG / "comm" / "bcast_gather.py").exists()


# ---------------------------------------------------------------------------------------------
# A fragment schedule is one function and one registry line
# ---------------------------------------------------------------------------------------------

REVERSE_SCHEDULE = '''
"""`policy.fragment_schedule=reverse`: the fragments synced last to first, a schedule added as one file."""

from __future__ import annotations


def reverse(sizes: list[int]) -> list[int]:
    return list(range(len(sizes)))[::-1]
'''

STREAMING = ["policy=async", "policy.tune=false", "policy.anchor=6", "policy.fragments=3"]


@pytest.mark.mpi
def test_a_fragment_schedule_is_one_file_and_one_registry_line(tmp_path):
    """In a copy of the package: `policies/reverse_schedule.py` and its line in
    `policies/fragment_schedule.py`; `policy.fragment_schedule=reverse` trains, and the epoch
    records' `fragment_trace` shows the fragments synced 2, 1, 0, 2, ... where the default
    schedule syncs them 0, 1, 2, 0, ..."""
    copy = _copy_package(tmp_path)
    (copy / "hpc_rlx" / "policies" / "reverse_schedule.py").write_text(textwrap.dedent(REVERSE_SCHEDULE))
    _add_line_after(copy / "hpc_rlx" / "policies" / "fragment_schedule.py", '    "round_robin": round_robin,\n',
                    '    "reverse": __import__("hpc_rlx.policies.reverse_schedule", fromlist=["reverse"]).reverse,\n')
    assert _changed_files(copy) == {"policies/reverse_schedule.py", "policies/fragment_schedule.py"}
    for schedule, cycle, run_name in (("reverse", [2, 1, 0], "run"), ("round_robin", [0, 1, 2], "default")):
        proc, run_dir = _train_copy(copy, tmp_path, STREAMING + [f"policy.fragment_schedule={schedule}"],
                                    run_name=run_name)
        assert proc.returncode == 0, explain(proc)
        epochs = read_metrics(run_dir)
        assert len(epochs) == 3 and epochs[-1]["train_loss"] < epochs[0]["train_loss"], epochs
        synced = [j for r in epochs for j in r["fragment_trace"]]
        assert len(synced) >= 6 and synced == [cycle[i % 3] for i in range(len(synced))], (schedule, synced)
        assert f"fragment_schedule: {schedule}" in (run_dir / "config.yaml").read_text()
    assert not (PKG / "policies" / "reverse_schedule.py").exists()


# ---------------------------------------------------------------------------------------------
# Small habits: no private access across modules, short functions, capabilities instead of
# probing array types, a typed policy/loop contract
# ---------------------------------------------------------------------------------------------

# Each KNOWN_* set lists violations still allowed (none now); it may only shrink: a check fails
# on a violation not listed and on a listed one that no longer occurs.

def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node) -> bool:
    """`self`, `cls`, `super()` or `type(self)`: an object's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("super", "type")


# Underscored names that are documented public API: os._exit (leave without cleanup), and a
# namedtuple's own methods.
PUBLIC_UNDERSCORED = {"os._exit", "_replace", "_asdict", "_fields", "_make"}


def private_accesses(pkg: Path = PKG) -> set[str]:
    """`file:name` for each private name read from another module or object: `from m import
    _x`, `obj._x` and `getattr(obj, "_x")` where obj is not self, cls, super() or type(self)."""
    found = set()
    for path in pkg.rglob("*.py"):
        rel = path.relative_to(pkg).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) and not _own(node.value):
                if ast.unparse(node) not in PUBLIC_UNDERSCORED:
                    names = [node.attr]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr", "hasattr") \
                    and len(node.args) >= 2 and not _own(node.args[0]) and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str):
                names = [node.args[1].value]
            found |= {f"{rel}:{n}" for n in names if _is_private(n) and n not in PUBLIC_UNDERSCORED}
    return found


# comm/fragment_sync.py imports reduce's MPI loader by its old name; graph/onnx/map_resample.py
# and map_rows.py share other mapping modules' helpers.
KNOWN_PRIVATE_ACCESS: set = set()


def test_the_private_access_finder_finds_each_form(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("import os\nfrom b import _hidden, shown\nclass A:\n    def f(self, other):\n"
                              "        self._mine = super()._base + type(self)._cls\n"
                              "        return other._theirs, getattr(other, '_by_name'), os._exit, x._replace\n")
    assert private_accesses(pkg) == {"a.py:_hidden", "a.py:_theirs", "a.py:_by_name"}


def test_no_module_reads_another_module_or_objects_private_members():
    """A private member is its module's or class's own; another module that needs it asks for
    a public name (`checkpoint/h5file.py`'s file steps, `Executor.train_plan`, `data/hdf5.py`'s
    `open_dataset_file`), so the owner can change its insides without breaking a reader."""
    found = private_accesses()
    assert found <= KNOWN_PRIVATE_ACCESS, sorted(found - KNOWN_PRIVATE_ACCESS)
    assert KNOWN_PRIVATE_ACCESS <= found, f"fixed, so take them out of KNOWN_PRIVATE_ACCESS: " \
                                          f"{sorted(KNOWN_PRIVATE_ACCESS - found)}"


MAX_FUNCTION_LINES = 80


def long_functions(pkg: Path = PKG) -> set[str]:
    """`file:Class.function` for each function (nested ones too) over MAX_FUNCTION_LINES lines."""
    found = set()

    def visit(node, prefix: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > MAX_FUNCTION_LINES:
                    found.add(f"{rel}:{name}")
                visit(child, name + ".", rel)
            else:
                visit(child, prefix, rel)

    for path in pkg.rglob("*.py"):
        visit(ast.parse(path.read_text()), "", path.relative_to(pkg).as_posix())
    return found


def test_the_long_function_finder_counts_lines(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (pkg / "a.py").write_text(f"def fits():\n{body}\nclass C:\n    def over(self):\n"
                              + textwrap.indent(body + "    x = 0\n", "    "))
    assert long_functions(pkg) == {"a.py:C.over"}


def test_no_function_is_over_80_lines():
    """A function past this does several things: give each its name."""
    assert long_functions() == set()


# Attributes whose presence tells a device array from a host one (or one array library from
# another): `.get()` (CuPy's copy to the host), `.device`, and the array interchange protocols.
ARRAY_PROBES = {"get", "device", "__cuda_array_interface__", "__array_interface__", "__dlpack__",
                "__dlpack_device__", "toDlpack", "data_ptr"}


def array_type_probes(pkg: Path = PKG) -> set[str]:
    """`file:line` for each `hasattr(x, NAME)` or `getattr(x, NAME, default)` with NAME in
    ARRAY_PROBES: a guess at the array's kind where `base.backend` knows it (`is_host(xp)`,
    `is_device_array(a)`, `to_numpy(a)`)."""
    found = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("hasattr", "getattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in ARRAY_PROBES:
                found.add(f"{path.relative_to(pkg).as_posix()}:{node.lineno}")
    return found


def test_the_array_probe_finder_finds_hasattr_and_getattr(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def host(a):\n    return a.get() if hasattr(a, 'get') else a\n"
                              "def dev(a):\n    return getattr(a, 'device', None)\n"
                              "def fine(d):\n    return hasattr(d, 'items')\n")
    assert array_type_probes(pkg) == {"a.py:2", "a.py:4"}


def test_no_code_probes_array_types_with_hasattr():
    """Host or device is asked of `base.backend` (`is_host`, `is_device_array`, `to_numpy`),
    never guessed from what attributes an array happens to have."""
    assert array_type_probes() == set()


LOOP_CONTRACT = PKG / "policies" / "loop_contract.py"
# The contract's Protocols, and the names by which policy code reaches each.
CONTRACT_PROTOCOLS = {"Loop": ("loop",), "LoopWorker": ("worker", "loop.worker"),
                      "StepLanes": ("lanes", "loop.lanes"), "StepHooks": ("loop.hooks",)}
KNOWN_UNTYPED_LOOPS: set = set()


def _declared_members(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | \
           {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}


def _used_members(bases: tuple[str, ...]) -> set[str]:
    used = set()
    for path in (PKG / "policies").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in bases:
                used.add(node.attr)
    return used


def untyped_loops(pkg: Path = PKG) -> set[str]:
    """`file:Class.method` for each function in policies/ whose `loop` is not annotated `Loop`."""
    found = set()
    for path in (pkg / "policies").glob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in [tree, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            prefix = f"{cls.name}." if isinstance(cls, ast.ClassDef) else ""
            for fn in [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for arg in fn.args.args + fn.args.kwonlyargs:
                    if arg.arg == "loop" and (arg.annotation is None or ast.unparse(arg.annotation) != "Loop"):
                        found.add(f"{path.relative_to(pkg).as_posix()}:{prefix}{fn.name}")
    return found


def test_the_policy_loop_contract_is_a_typed_protocol():
    """Policies get the run as `Loop`, a `typing.Protocol` whose members (and the worker's, the
    lanes' and the hooks' under it) are typed, not `Any`, and are exactly those some policy
    uses: a policy that reaches for more of the run, or a member no policy uses, fails here."""
    import typing

    from hpc_rlx.policies import base, loop_contract
    assert base.Loop is loop_contract.Loop
    tree = ast.parse(LOOP_CONTRACT.read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    for name, reached_as in CONTRACT_PROTOCOLS.items():
        assert typing.Protocol in getattr(loop_contract, name).__mro__, f"{name} is not a typing.Protocol"
        untyped = [n.target.id for n in classes[name].body
                   if isinstance(n, ast.AnnAssign) and ast.unparse(n.annotation) in ("Any", "typing.Any")]
        assert not untyped, f"{name} types {untyped} as Any"
        declared, used = _declared_members(classes[name]), _used_members(reached_as)
        assert used <= declared, f"policies use {sorted(used - declared)} of {name}, which it does not declare"
        assert declared <= used, f"{name} declares {sorted(declared - used)}, which no policy uses"
    found = untyped_loops()
    assert found <= KNOWN_UNTYPED_LOOPS, sorted(found - KNOWN_UNTYPED_LOOPS)
    assert KNOWN_UNTYPED_LOOPS <= found, f"typed, so take them out of KNOWN_UNTYPED_LOOPS: " \
                                         f"{sorted(KNOWN_UNTYPED_LOOPS - found)}"
