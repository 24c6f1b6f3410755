"""Every config key, declared once: its type, default, one-line doc and check.

The YAML files in `configs/` are what Hydra composes and what users read; this table is what
the code reads. `tests/unit/config/test_schema.py` holds the two together (every YAML key is
declared here with the same default, every key declared here is in the YAML), and the
config table of docs/config.md is generated from it (`hpc_rlx.config.doc`).

- Sections with one shape (`train`, `comm`, `report`, `trace`, `debug`, `resume`) declare a
  default per key.
- Group sections (`model`, `data`, `optim`, `device`, `checkpoint`) declare each key once
  with `Options`: the group options that have the key, each with its default (`optim.lr` is
  0.1 under `optim=sgd`, 0.003 under `optim=adamw`). The builders and the optimizer classes
  keep the range checks of their own parameters (`graph.models`, `optim`): their signature
  defaults are library defaults, not these config defaults, so they cannot serve as the
  declaration, and their checks stay where the value is used.
- `policy.*` keys are declared by each policy class (`Policy.defaults`, `Policy.key_docs`,
  `Policy.check_config`) and only referred to here; so are each optimizer's own `optim.*`
  keys and its default `optim.lr` (`Optimizer.hyper`, `Optimizer.lr`: `hpc_rlx/optim/`).

Adding a key: one `Key(...)` line here (`data.*` in `config/keys_data.py`, `model.*` in
`config/keys_model.py`; `Key` and the groups are `config/key.py`), the key in its YAML file, and the regenerated table
of docs/config.md. Code reads it through the validated, completed section (`complete`), never with a
default of its own; a TrainSpec's sections refuse any key not declared here
(`config/section.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from hpc_rlx.base.checks import BOOL, INT64, Check, OneOf, Via, integer, is_int, is_number, number
from hpc_rlx.comm.registry import check_settings as _check_reduction, choices as _reductions
from hpc_rlx.config.key import DATASETS, DEVICES, GROUPS, MODELS, OPTIMIZERS, Key, Options, every, selector
from hpc_rlx.config.keys_data import DATA_KEYS, CACHES, DISTRIBUTIONS
from hpc_rlx.config.keys_model import BUILT, MODEL_KEYS
from hpc_rlx.device.host_blas import CPU_BLAS
from hpc_rlx.base.errors import ConfigError
from hpc_rlx.config.tensorboard_setting import enabled as tensorboard_enabled
from hpc_rlx.pipeline.grid import check_world
from hpc_rlx.pipeline.schedule import PIPELINE_SCHEDULES
from hpc_rlx.optim.registry import OPTIMIZERS as _OPTIMIZERS
from hpc_rlx.policies.config import validate_policy_config
from hpc_rlx.policies.registry import POLICIES
from hpc_rlx.injection import FAIL_MODES, FAIL_POINTS
from hpc_rlx.injection.slowdown import parse_slowdown

# comm.on_failure's choices; what each means, and what shrink and spare cannot run with:
# hpc_rlx/resilience/mode.py
ON_FAILURE = ("abort", "shrink", "spare")

# The checkers are `hpc_rlx.base.checks` (one family for the whole package): a test of one value
# and the message that names the key and the value. Here: the checks of two keys only.


def _check_stages(v, world_size) -> None:
    integer(1)("parallel.pipeline_stages", v)
    if world_size is not None:
        check_world(world_size, v)


def _check_fail_rank(v, world_size) -> None:
    """debug.fail_rank: a rank or a list of ranks, each inside the world (spares included)."""
    ranks = v if isinstance(v, list) else [v]
    if v is None:
        return
    if not ranks or not all(is_int(r) and r >= 0 for r in ranks):
        raise ConfigError(f"debug.fail_rank must be null, a rank or a list of ranks, got {v!r}")
    if world_size is not None and max(ranks) >= world_size:
        raise ConfigError(f"debug.fail_rank={v!r} names a rank outside the world of {world_size} "
                          f"(the largest rank is {world_size - 1}): nothing would fail")


def _stall_abort(v) -> bool:
    return v is None or v == "auto" or (is_number(v) and v > 0)


# ---------------------------------------------------------------------------------------------
# The declarations
# ---------------------------------------------------------------------------------------------


DTYPES = ("float32", "float64")
ON_NONFINITE = ("stop", "skip")
CKPT_METRICS = ("val_loss", "val_accuracy", "val_iou", "val_mae")
PROGRESS = ("auto", "bar", "lines")
_NUMBER = (int, float)
_OPT_NONNEG = number(0, null=True, must="must be a number >= 0")
_OPT_STEPS = integer(0, null=True, must="must be an integer >= 0")


def _optimizer_keys() -> list[Key]:
    """`optim.*` keys as the optimizers declare them (`optim/base.py`): a key several take is
    one Key, with each one's default, and a doc that says whose meaning is whose."""
    by_name: dict[str, list] = {}
    for option, cls in _OPTIMIZERS.items():
        for h in cls.hyper:
            by_name.setdefault(h.name, []).append((option, h))
    keys = []
    for name, declared in by_name.items():
        docs: dict[str, list[str]] = {}
        for option, h in declared:
            docs.setdefault(h.doc, []).append(f"`{option}`")
        doc = "; ".join(f"{', '.join(who)}: {text}" for text, who in docs.items())
        first = declared[0][1]
        keys.append(Key(f"optim.{name}", first.type, Options((o, h.default) for o, h in declared), doc,
                        first.check))
    return keys




KEYS: tuple[Key, ...] = (
    Key("train.epochs", int, 20, "epochs", integer(1)),
    Key("train.batch_size", int, 64, "global batch per step, split over ranks and lanes", integer(1)),
    Key("train.seed", int, 0, "init, shuffling and dropout seed", integer(0)),
    Key("train.dtype", str, "float32", "`float32` or `float64`", OneOf(*DTYPES)),
    Key("train.on_nonfinite", str, "stop", "`stop` or `skip` a step where any rank saw NaN/Inf",
        OneOf(*ON_NONFINITE)),
    Key("train.max_consecutive_skips", int, 100, "with `on_nonfinite=skip`, fail after this many "
        "skipped steps in a row (0 = never)", integer(0, null=True, must="must be an integer >= 0")),
    Key("train.max_steps", int, None, "stop after this many steps (the LR schedule still spans "
        "`train.epochs`, so a resume continues it exactly)", integer(1, null=True)),
    Key("train.log_every_s", _NUMBER, 10, "period of the plain progress lines (batch jobs, piped "
        "output); the first comes after the run's first step (0 = every step)",
        number(0, null=True, must="must be null or a number >= 0")),
    Key("train.progress", str, "auto", "`auto`, `bar` or `lines`: see \"Progress\" below", OneOf(*PROGRESS)),
    Key("train.accumulate", int, 1, "gradient accumulation: each lane runs its share of a step in this "
        "many micro-batches, summed before the one Allreduce (activation memory about 1/K)", integer(1)),
    Key("train.eval_batch_size", int, None, "validation rows per rank per forward; null = the rank's "
        "largest training micro-batch, at most 1024", integer(1, null=True, must="must be null or an integer >= 1")),
    Key("train.threads_per_rank", int, None, "BLAS threads per rank; null = cores per node / ranks per node",
        integer(1, null=True, must="must be null or an integer >= 1")),
    Key("report.plots", bool, True, "PNG plots in `RUN_DIR/plots` at the end of the run"),
    Key("report.tensorboard", (str, bool), "auto", "TensorBoard event files in `RUN_DIR/tensorboard`: "
        "`auto` (when tensorboardX is installed, as `scripts/install.sh` does), `true` (an error if "
        "it is not), `false`", Via(lambda v, _: tensorboard_enabled(v), "is auto, true or false")),
    Key("trace.enabled", bool, False, "Chrome trace of every rank and lane (`RUN_DIR/trace.json`)"),
    Key("trace.max_events", int, 500000, "events kept per rank (later ones are counted, not kept)"),
    selector("optim", "name", OPTIMIZERS),
    Key("optim.lr", _NUMBER, Options((n, c.lr) for n, c in _OPTIMIZERS.items()), "base learning rate",
        number(0, above=True, must="must be a positive number")),
    *_optimizer_keys(),
    Key("optim.clip_grad_norm", _NUMBER, every(OPTIMIZERS, None), "clip the global gradient norm; "
        "null = no clipping", number(0, above=True, null=True)),
    Key("optim.lr_scale_ratio", _NUMBER, every(OPTIMIZERS, 0.0), "`lr × (1 + (world − 1) × ratio)`; "
        "1.0 = linear scaling rule", number(0, null=True, must="must be >= 0")),
    Key("optim.schedule", str, every(OPTIMIZERS, "cosine"), "`constant`, `step`, `multistep` or `cosine`"),
    Key("optim.warmup_steps", int, every(OPTIMIZERS, 0), "linear warm-up steps", _OPT_STEPS),
    Key("optim.step_size", int, every(OPTIMIZERS, 1000), "steps between decays (`schedule=step`)",
        _OPT_STEPS),
    Key("optim.gamma", _NUMBER, every(OPTIMIZERS, 0.1), "decay factor (`schedule=step|multistep`)", _OPT_NONNEG),
    Key("optim.milestones", list, every(OPTIMIZERS, []), "`schedule=multistep`: the steps, counted from the "
        "end of the warm-up, at which the LR is multiplied by `gamma`"),
    Key("optim.min_lr", _NUMBER, every(OPTIMIZERS, 0.0), "floor of the cosine", _OPT_NONNEG),
    Key("optim.no_decay", list, every(OPTIMIZERS, []), "parameter-name globs (PyTorch names for "
        "`model=onnx`) without weight decay; with LAMB and LARS also without a trust ratio",
        Check(lambda v: v is None or (isinstance(v, list) and all(isinstance(g, str) and g for g in v)),
              "must be a list of parameter-name globs")),
    Key("optim.lr_mult", dict, every(OPTIMIZERS, None), "`{glob: factor}`: a parameter's learning rate "
        "times the factor of the first glob that matches its name"),
    selector("device", "kind", DEVICES, OneOf(*DEVICES)),
    Key("device.cpu_lanes", int, Options(cpu=1, cuda=0, all=1, auto=1), "CPU (NumPy) lanes per rank",
        integer(0)),
    Key("device.gpus_per_rank", int, every(DEVICES, 1), "GPU (CuPy) lanes per rank for cuda/all "
        "(checked by the lanes)"),
    Key("device.cpu_blas", str, every(DEVICES, "numpy"), "the CPU lanes' matrix products: `numpy` "
        "(NumPy's BLAS) or `mkl` (Intel MKL's GEMM through ctypes: pip install mkl; 2-D float "
        "products only, the rest stays NumPy's)", OneOf(*CPU_BLAS)),
    Key("comm.bucket_cap_mb", _NUMBER, 16, "Allreduce chunk size (MPICH slows ~3× at 32 MiB messages)",
        number(0, above=True)),
    Key("comm.deterministic", bool, False, "fixed reduction order: bitwise-reproducible runs for a "
        "given world size"),
    Key("comm.overlap", bool, False, "start each gradient chunk's Allreduce as soon as backward "
        "finished it (policy sync, one CPU lane, host path; off under comm.deterministic, the "
        "16-bit wire and GPU buckets)"),
    Key("comm.overlap_chunk_mb", _NUMBER, 1, "chunk size of comm.overlap's non-blocking Allreduces",
        number(0, above=True)),
    Key("comm.shared_memory", bool, True, "sum the bucket within each node in memory its ranks "
        "share (one shared window per node), then across nodes by MPI; used where every rank has "
        "CPU lanes only, every node the same number of ranks (> 1) and /dev/shm room, and neither "
        "comm.deterministic, comm.wire_dtype nor comm.overlap is set and comm.reduction is auto (else "
        "the start-up line says which did not hold); with comm.shard=optimizer, its reduce-scatter "
        "and allgather within each node, then across nodes by MPI (comm.deterministic allowed on "
        "one node); false = MPI's Allreduce"),
    Key("comm.stall_warning_s", _NUMBER, 60, "stall watchdog: report ranks that have not reached a "
        "collective after this long; null = off",
        number(0, null=True, must="must be null (off) or a number of seconds >= 0")),
    Key("comm.stall_abort_s", (str, int, float), "auto", "`auto` aborts a job that is stuck (no rank "
        "alive and busy outside a collective) after 600 s, a number aborts after that long whatever "
        "the other ranks do, `null` never (docs/reliability.md)",
        Check(_stall_abort, "must be auto, null (never) or a number of seconds > 0")),
    Key("comm.cuda_aware", (str, bool), "auto", "`auto`, `true` or `false`: all-reduce the GPU bucket "
        "directly or through pinned host memory (checked by the lanes)"),
    Key("comm.wire_dtype", str, None, "`bfloat16` or `float16` on the wire, float32 sums; null = "
        "the compute dtype (checked by the bucket)"),
    Key("comm.reduction", str, "auto", "the bucket's reduction path by name (`hpc_rlx/comm/registry.py`): "
        "`auto` picks `wire` under comm.wire_dtype, `ordered` under comm.deterministic, else `host` "
        "(MPI's SUM), under comm.shard=optimizer the reduce-scatter; a named path must serve those "
        "settings (under comm.shard=optimizer: one that gathers the parameters its own way)", OneOf(*_reductions())),
    Key("comm.shard", str, "none", "`optimizer`: each rank holds the optimizer state of one slice of "
        "the parameters (ZeRO-1): the gradients are reduce-scattered, each rank steps its slice, the "
        "parameters are all-gathered (with pipeline stages, among each stage's replicas); policy=sync, "
        "without comm.overlap; `none`: "
        "every rank holds all of it", OneOf("none", "optimizer")),
    Key("comm.node_shared_params", bool, False, "true: the ranks of a node read the parameters from "
        "one array in the node's shared memory, each writing its slice after the step (one copy per "
        "node); with comm.shard=optimizer, policy=sync and CPU lanes, without pipeline stages, "
        "comm.deterministic, comm.wire_dtype or comm.overlap"),
    Key("comm.on_failure", str, "abort", "what a dead rank does to the job: `abort` ends it (resume "
        "from the last checkpoint); `shrink`: the survivors drop it and train on (MPI's ULFM: "
        "`mpirun --with-ft ulfm`, Open MPI 5; docs/reliability.md); `spare`: one of comm.spares "
        "waiting ranks takes its place and its shard (the world size and data plan unchanged), as "
        "`shrink` once none is left", OneOf(*ON_FAILURE)),
    Key("comm.spares", int, 0, "spare ranks for `comm.on_failure=spare`: the job's last K ranks hold "
        "the model and train nothing until one replaces a dead rank (launch N + K ranks)", integer(0)),
    Key("parallel.pipeline_stages", int, 1, "pipeline stages S: the model split into S stages on "
        "S ranks each, world size = replicas x S (1 = data parallel only)",
        Via(_check_stages, "must be a positive integer dividing the world size")),
    Key("parallel.microbatches", int, 4, "micro-batches per replica batch with pipeline stages "
        "(fewer when the batch has fewer rows)", integer(1)),
    Key("parallel.schedule", str, "1f1b", "`1f1b` (at most S micro-batches of activations alive per "
        "stage) or `gpipe` (all M)", OneOf(*PIPELINE_SCHEDULES)),
    Key("parallel.cut_points", list, None, "graph nodes after which a stage ends (S - 1 of them); "
        "null = split balanced (`parallel.balance`)",
        Check(lambda v: v is None or (isinstance(v, list) and all(isinstance(c, str) for c in v)),
              "must be null or a list of node names")),
    Key("parallel.balance", str, "time", "without cut points: `time` (rank 0 balances the stages by "
        "parameter count plus each node's measured forward + backward time, scaled to weigh as much) "
        "or `params` (parameter count only)", OneOf("time", "params")),
    *DATA_KEYS,
    Key("checkpoint.every_steps", int, every(("default", "off"), None), "checkpoint every N steps",
        integer(1, null=True, must="must be null or an integer > 0")),
    Key("checkpoint.every_epochs", int, every(("default", "off"), None), "checkpoint every N epochs",
        integer(1, null=True, must="must be null or an integer > 0")),
    Key("checkpoint.every_minutes", _NUMBER, Options(default=10, off=None), "checkpoint every N minutes "
        "of training (always also at the end of the run and on preemption)", number(0, above=True, null=True)),
    Key("checkpoint.keep_last", int, every(("default", "off"), 2), "checkpoints kept, plus the best by "
        "`checkpoint.metric` (held in memory, written with the next save)", integer(1, must="must be >= 1")),
    Key("checkpoint.metric", str, every(("default", "off"), "val_loss"), "`val_loss` (lower is better), "
        "`val_accuracy` or `val_iou` (higher is better), or `val_mae` (lower is better)", OneOf(*CKPT_METRICS)),
    Key("checkpoint.requeue", bool, every(("default", "off"), False), "on SIGUSR1/SIGTERM under Slurm, "
        "rank 0 runs `scontrol requeue` (for `mpirun` inside a batch script; `slurm/train.sh` "
        "requeues by itself)"),
    Key("debug.slowdown", dict, None, "`{rank: factor}`: make ranks honestly slower, to simulate "
        "mixed hardware", Via(parse_slowdown, "is a mapping {rank: factor}")),
    Key("debug.fail_rank", (int, list), None, "inject a failure on this rank, or on each rank of a "
        "list at once (reliability tests) ...",
        Via(_check_fail_rank, "must be null, a rank or a list of ranks inside the world")),
    Key("debug.fail_point", str, None, "... at `spec` (before the spec's broadcast: rank 0 before it sends "
        "it, another rank, reading debug.* from the command line, before it receives it), `startup`, "
        "`broadcast` (before the initial weights'), `data`, `step` (before its forward), `recovery` "
        "(fail_rank's first rank at `step`, the others in the recovery from it), "
        "`allreduce` (before the step's Allreduce), `validation` (before the epoch's), `checkpoint` "
        "(before one is written) or `scatter` (data.distribution=scatter: the rows' scatter at load, step 0, "
        "or the streamed round of the window from fail_step) or `finish` (after the last step, before the run's "
        "summary is gathered)",
        Check(lambda v: v is None or v in FAIL_POINTS, f"must be null or one of {', '.join(FAIL_POINTS)}")),
    Key("debug.fail_step", int, 0, "... (`fail_point=step|allreduce|validation|recovery|scatter`) at this global step"),
    Key("debug.fail_mode", str, "raise", "... `raise` an exception, or `kill`: the rank sends itself "
        "SIGKILL (a dead rank, for comm.on_failure)", OneOf(*FAIL_MODES)),
    Key("debug.stall_rank", int, None, "this rank arrives `stall_s` late at the first watched collective ..."),
    Key("debug.stall_step", int, 0, "... from this global step on (exercises the stall watchdog)"),
    Key("debug.stall_s", _NUMBER, 0, "... by this many seconds"),
    Key("debug.nan_rank", int, None, "this rank puts a NaN into its gradient ..."),
    Key("debug.nan_step", int, 0, "... at this global step (exercises `train.on_nonfinite`)"),
    Key("resume", str, "auto", "`auto`, `none`, a checkpoint file, or a run directory (its newest "
        "valid checkpoint)"),
    *MODEL_KEYS,
)
# the model keys a builder of graph.models takes from the config (the rest come from the data;
# the loss keys weigh the built graph's cross-entropy: config/loss_keys.py; the freeze keys mark
# its frozen parameters: graph/frozen.py)
LOSS_KEYS = ("class_weights", "ignore_index", "class_axis")
FREEZE_KEYS = ("freeze", "train_only")
BUILDER_KEYS = {m: tuple(k.name for k in KEYS if k.section == "model" and m in (k.options() or ())
                         and k.name not in ("name", "num_classes", "init_from", "path", *LOSS_KEYS, *FREEZE_KEYS)
                         and "." not in k.name)     # nested keys (model.lora.*) are not a builder's
                for m in BUILT}
BY_PATH: dict[str, Key] = {k.path: k for k in KEYS}
SECTIONS = tuple(dict.fromkeys(k.section for k in KEYS if "." in k.path))
TOP_LEVEL = tuple(k.path for k in KEYS if "." not in k.path)


def keys_of(section: str, option: str | None = None) -> Iterator[Key]:
    """The keys of a section; of a group section, those of `option` (all options if None)."""
    for k in KEYS:
        if k.section == section and "." in k.path and (option is None or k.options() is None
                                                         or option in k.options()):
            yield k


def option_of(section: str, values: Mapping[str, Any]) -> str:
    """The group option a composed section is, by its `name`/`kind` key, else the group default."""
    selector, options, default = GROUPS[section]
    chosen = values.get(selector) if selector else None
    return chosen if chosen in options else default


def defaults(section: str, option: str | None = None) -> dict[str, Any]:
    """A section's defaults (of a group: of `option`, default the group's default option)."""
    if section == "policy":
        return {"name": option or "sync", **POLICIES[option or "sync"].defaults}
    option = option or (GROUPS[section][2] if section in GROUPS else None)
    out: dict[str, Any] = {}
    for k in keys_of(section, option):
        head, _, leaf = k.name.partition(".")
        if leaf:        # a nested key (model.lora.rank): a mapping under its head
            out.setdefault(head, {})[leaf] = k.default_for(option)
        else:
            out[k.name] = k.default_for(option)
    return out


def nested_heads(section: str) -> frozenset[str]:
    """The heads of a section's nested keys (`lora` of `model.lora.rank`)."""
    return frozenset(k.name.partition(".")[0] for k in keys_of(section) if "." in k.name)


def _over_defaults(section: str, base: dict, given: Mapping[str, Any]) -> dict:
    """`given` over `base`, a nested mapping (`model.lora`) merged key by key."""
    out = {**base, **given}
    for head in nested_heads(section):
        if isinstance(base.get(head), dict) and isinstance(given.get(head), Mapping):
            out[head] = {**base[head], **given[head]}
    return out


ABSENT = object()


def value_of(values: Mapping[str, Any], name: str):
    """A key's value in a section by its name (`lora.rank` reads `values["lora"]["rank"]`), or
    `ABSENT`."""
    head, _, leaf = name.partition(".")
    if not leaf:
        return values.get(name, ABSENT)
    inner = values.get(head)
    return inner.get(leaf, ABSENT) if isinstance(inner, Mapping) else ABSENT


def default(path: str):
    """One key's default (of a group key: under the group's default option)."""
    key = BY_PATH[path]
    return key.default_for(GROUPS[key.section][2] if key.options() else None)


def complete(cfg: Mapping[str, Any]) -> dict:
    """`cfg` with every declared key present: the given values over the declared defaults.
    A group section is completed with its own option's defaults; `policy` is left as given
    (the policy completes its own keys)."""
    out = dict(cfg)
    for section in SECTIONS:
        given = dict(cfg.get(section) or {})
        if section in GROUPS:
            selector, options, _ = GROUPS[section]
            chosen = given.get(selector) if selector else GROUPS[section][2]
            if chosen not in options:
                out[section] = given      # an unknown option: whoever reads it reports it
                continue
            out[section] = _over_defaults(section, defaults(section, chosen), given)
        else:
            out[section] = _over_defaults(section, defaults(section), given)
    for path in TOP_LEVEL:
        out.setdefault(path, BY_PATH[path].default)
    return out


# Rules between keys of one section, checked after that section's own keys.
def _device_rule(dev: Mapping[str, Any]) -> None:
    if dev["kind"] == "cpu" and dev["cpu_lanes"] < 1:
        raise ConfigError("device=cpu needs device.cpu_lanes >= 1")


def _comm_rule(c: Mapping[str, Any]) -> None:
    warn, stall_abort = c["stall_warning_s"], c["stall_abort_s"]
    if not (stall_abort in (None, "auto") or (is_number(warn) and warn > 0)):
        raise ConfigError(f"comm.stall_abort_s={stall_abort!r} needs the watchdog on: "
                          f"comm.stall_warning_s > 0, got {warn!r}")
    _check_reduction(c["reduction"], c["deterministic"], c["wire_dtype"], c["shard"])


def _check_option_keys(section: str, values: Mapping[str, Any]) -> None:
    """A group section renamed to another option (`optim.name=adamw` on `optim=sgd`) keeps the
    keys of the option it came from: refuse it instead of mixing the two."""
    if section not in GROUPS or GROUPS[section][0] is None:
        return
    selector, options, _ = GROUPS[section]
    chosen = values.get(selector)
    if chosen in options:
        extra = sorted(set(values) - {k.name.partition(".")[0] for k in keys_of(section, chosen)})
        if extra:
            raise ConfigError(f"{section}.{selector}={chosen!r} does not take {extra} (keys of "
                              f"another {section} option); select the option itself: {section}={chosen}")


def _check_nested(section: str, values: Mapping[str, Any]) -> None:
    """A nested mapping (`model.lora`) is a mapping of its declared keys only."""
    for head in sorted(nested_heads(section)):
        inner = values.get(head, {})
        names = {k.name.partition(".")[2] for k in keys_of(section) if k.name.startswith(head + ".")}
        if not isinstance(inner, Mapping):
            raise ConfigError(f"{section}.{head} must be a mapping of {sorted(names)}, got {inner!r}")
        extra = sorted(set(inner) - names)
        if extra:
            raise ConfigError(f"{section}.{head} does not take {extra}; its keys: {sorted(names)}")


RULES: dict[str, Callable[[Mapping[str, Any]], None]] = {"device": _device_rule, "comm": _comm_rule}
# the order sections are checked in (the first bad key found is the one reported)
CHECK_ORDER = ("train", "report", "trace", "optim", "device", "comm", "parallel", "data", "checkpoint",
               "policy", "debug", "model")


def validate(cfg: Mapping[str, Any], world_size: int | None = None) -> dict:
    """Check every declared key of a composed config; return it completed (`complete`).

    Group sections are checked key by key as given (an `optim=sgd` section overridden with
    `optim.name=adamw` still has SGD's keys; the optimizer reports the mismatch)."""
    cfg = complete(cfg)
    for section in CHECK_ORDER:
        if section == "policy":
            validate_policy_config(cfg["policy"])
            continue
        values = cfg[section]
        _check_option_keys(section, values)
        _check_nested(section, values)
        for key in keys_of(section):
            value = value_of(values, key.name)
            if value is not ABSENT:
                key.validate(value, world_size)
        if section in RULES:
            RULES[section](values)
    return cfg
