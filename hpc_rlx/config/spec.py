"""The TrainSpec: everything a worker needs to train a model it has no code for.

Rank 0 turns the composed Hydra config into a TrainSpec (`build_spec`), which is a few KB of
plain JSON-able data and is broadcast to every rank. Parameter values are *not* in the
spec: rank 0 materialises them (`initial_parameters`) and broadcasts them by buffer.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Mapping

import h5py
import numpy as np

from hpc_rlx.config import schema as schema
from hpc_rlx.config.batch_norm_sync import check_sync_batch_norm
from hpc_rlx.config.rundirs import fingerprint_of
from hpc_rlx.config.section import SECTIONS, section
from hpc_rlx.config.loss_keys import apply_loss_keys, check_checkpoint_metric
from hpc_rlx.config.run_dir_check import check_run_dir_writable
from hpc_rlx.config.sharding import check_shard
from hpc_rlx.data import hdf5
from hpc_rlx.data.plan import plan_shards
from hpc_rlx.config.model_inputs import input_sources
from hpc_rlx.data.resolve import num_classes, prepare_missing_data
from hpc_rlx.base.errors import ConfigError, DataError, phase
from hpc_rlx.graph import BUILDERS, Graph, ParamLayout, build_model, freeze_params, init_params, trainable_user_names
from hpc_rlx.graph.lora import add_adapters, adapter_ir_names, initial_adapters, lora_settings
from hpc_rlx.graph.onnx.importer import import_onnx
from hpc_rlx.graph.node_timing import node_times, time_cost
from hpc_rlx.graph.partition import partition
from hpc_rlx.pipeline.grid import check_world
from hpc_rlx.policies.registry import POLICIES
from hpc_rlx.optim import LR_SCHEDULES, make_optimizer, make_schedule, optimizer_kwargs, parameter_copies, settings_for


@dataclass
class DataPlan:
    path: str
    x: str
    y: str
    n_train: int                 # rows [0, n_train) of `path` are training data
    val_path: str | None         # validation rows come from here ...
    val_start: int               # ... rows [val_start, val_stop)
    val_stop: int
    distribution: str
    leftover: str
    shuffle: bool
    check_finite: bool
    sample_shape: list
    x_dtype: str
    y_dtype: str
    cache: str = "memory"        # memory | stream (runtime/feed.py)
    y_shape: list = field(default_factory=list)   # per-sample label shape: a shard's size in memory
    stage_dir: str | None = None  # data.stage_dir: node-local copies first (runtime/staging.py)
    stage_keep: bool = False
    files: list | None = None      # [[file, samples], ...] of `path` in order (data/fileset.py)
    val_files: list | None = None  # ... of `val_path`; None: validation is the tail of `files`
    one_sample: bool = False       # data.one_sample_per_file
    inputs: list | None = None     # data.x of several: [[dataset, row shape, dtype]] (packed: data/model_inputs.py)


@dataclass
class TrainSpec:
    graph: dict                  # the model graph IR (hpc_rlx.graph JSON form)
    param_source: dict           # {"kind": "seed", "seed": s} or {"kind": "file", "path": p}
    data: DataPlan
    train: Mapping               # the config sections (config/section.py: read-only, declared keys)
    optim: Mapping
    policy: Mapping
    device: Mapping
    comm: Mapping
    checkpoint: Mapping
    debug: Mapping
    report: Mapping              # report.* (plots, TensorBoard) and trace.* (the timeline)
    trace: Mapping
    run_dir: str
    resume: str
    world_size: int
    config_yaml: str = ""
    parallel: Mapping = field(default_factory=lambda: {"pipeline_stages": 1})   # parallel.* (pipeline stages)
    plan: str = ""                          # the shard plan in words, logged at start-up
    config_fingerprint: str | None = None   # which training this is (config/fingerprint.py)
    model_source: str | None = None         # model=onnx: the file the trained weights go back into
    sync_batch_norm: bool = False           # model.sync_batch_norm (config/batch_norm_sync.py)

    def __post_init__(self):
        # config sections: read-only, only their declared keys (config/section.py)
        for name in SECTIONS:
            setattr(self, name, section(name, getattr(self, name)))

    def to_dict(self) -> dict:
        d = asdict(self)            # a Section is copied whole: back to its plain JSON form
        for name in SECTIONS:
            d[name] = dict(d[name])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSpec":
        d = dict(d)
        d["data"] = DataPlan(**d["data"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def validate_config(cfg: dict, world_size: int | None = None) -> dict:
    """Check every key of a composed config against its declaration (`config.schema`) and
    return the config completed with the declared defaults. Every message names the key and
    the value; any value a command line can produce gives a ConfigError, never a TypeError.
    File paths come back with `~` expanded, as a shell would (`data.path='~/x.h5'`)."""
    completed = schema.validate(cfg, world_size)
    for section, key in (("data", "path"), ("data", "val_path"), ("model", "path")):
        if isinstance(completed[section].get(key), str):
            completed[section][key] = os.path.expanduser(completed[section][key])
    return completed


def check_lane_batch(dev: dict, global_batch: int, world_size: int) -> None:
    """Every lane needs at least one sample per step, or the ranks x lanes asked for are not
    all used. Checked where the lane count is known before the run (device=cpu / cuda)."""
    key = {"cpu": "cpu_lanes", "cuda": "gpus_per_rank"}.get(dev["kind"])
    lanes = dev[key] if key else None
    if not isinstance(lanes, int) or lanes <= 1:
        return
    per_rank = global_batch // world_size
    if per_rank < lanes:
        raise ConfigError(
            f"train.batch_size={global_batch} over {world_size} ranks gives a rank {per_rank} "
            f"sample(s) per step, fewer than its {lanes} lanes (device.{key}={lanes}); use "
            f"train.batch_size >= {world_size * lanes} (ranks x lanes) or fewer lanes")


def check_accumulate(train: dict, world_size: int) -> None:
    """More micro-batches (train.accumulate) than the busiest rank's samples per step: empty ones."""
    k = int(train.get("accumulate") or 1)
    per_rank = -(-int(train["batch_size"]) // world_size)
    if k > per_rank:
        raise ConfigError(f"train.accumulate={k} is more micro-batches than the {per_rank} sample(s) a rank "
                          f"takes per step (train.batch_size={train['batch_size']} over {world_size} ranks): "
                          f"the largest value that means something is {per_rank}")


def schedule_kwargs(opt: dict) -> dict:
    return {k: opt[k] for k in ("warmup_steps", "step_size", "gamma", "min_lr", "milestones")}


def check_optimizer(opt: dict, dtype: str, schedule_steps: int, graph=None) -> None:
    """Build the optimizer and schedule (and match optim.no_decay/lr_mult) once on rank 0: one error."""
    if graph is not None:
        settings_for(trainable_user_names(graph), opt.get("no_decay") or [], opt.get("lr_mult") or {})
    if opt["schedule"] not in LR_SCHEDULES:
        raise ConfigError(f"optim.schedule={opt['schedule']!r} is not one of {list(LR_SCHEDULES)}")
    try:
        with_config_keys("optim", optimizer_kwargs(opt), lambda: make_optimizer(
            opt["name"], 1, np, np.dtype(dtype), **optimizer_kwargs(opt)))
        with_config_keys("optim", schedule_kwargs(opt), lambda: make_schedule(
            opt["schedule"], float(opt["lr"]), schedule_steps, **schedule_kwargs(opt)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optim: {e}") from e


def with_config_keys(section: str, keys, build):
    """`build()`, its ConfigError about one of `keys` restated with the config key: the
    builders, optimizers and schedules are library code and name their own parameters
    (`ConfigError.bad_param`: `dropout must be in [0, 1)`, `sgd: momentum must be ...`); from a
    config the user needs `model.dropout`, `optim.momentum`. An error about anything else (a
    parameter no key sets, such as the schedule's `base_lr`) stays as it is."""
    try:
        return build()
    except ConfigError as e:
        if e.key is not None and e.key in keys:
            raise e.restated(section) from None
        raise


def check_model_fits(graph, cfg: dict, world_size: int, what: str = "the model") -> None:
    """Refuse, once and clearly, a model whose parameter-sized buffers cannot fit in this node's
    memory (instead of every rank dying in its own allocation). With pipeline stages, ``graph``
    is the largest stage: what one rank holds."""
    n = ParamLayout(graph).size
    itemsize = np.dtype(cfg["train"]["dtype"]).itemsize
    # params, gradient bucket, init buffer (float64), the optimizer's state and scratch, one per
    # extra CPU lane
    state = parameter_copies(cfg["optim"])
    if cfg["comm"].get("shard") == "optimizer":     # a rank holds its slice of the state only
        # sliced among the replicas of a stage (all ranks without pipeline stages)
        state /= max(1, world_size // max(1, int(cfg["parallel"]["pipeline_stages"])))
    copies = 3 + state + max(0, cfg["device"]["cpu_lanes"] - 1)
    need = n * itemsize * copies + n * 8
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > avail:
        raise ConfigError(f"{what} has {n:,} parameters: about {need / 2**30:.1f} GiB of parameter-sized "
                          f"buffers per rank, more than the {avail / 2**30:.1f} GiB of memory available "
                          f"on this node; use a smaller model")


def measured_cut_points(graph, stages: int, cfg: dict, replicas: int) -> list:
    """Rank 0, once: the cut points of the split balanced by parameter count and each node's
    forward + backward time, measured on a micro-batch of the run's shape (at most 64 rows).
    They go into the spec (``parallel.cut_points``), so every rank builds the same stages and
    none measures again."""
    par = cfg["parallel"]
    rows = -(-int(cfg["train"]["batch_size"]) // (replicas * int(par["microbatches"])))
    with phase("measuring each node's time for the pipeline split"):
        times = node_times(graph, max(1, min(64, rows)), cfg["train"]["dtype"])
    parts = partition(graph, stages, cost=time_cost(times, graph))
    cuts = [part.nodes[-1].name for part in parts[:-1]]
    shares = [f"{sum(times.get(n.name, 0.0) for n in p.nodes) * 1e3:.3f} ms, {ParamLayout(p).size:,} params"
              for p in parts]
    print(f"[hpc_rlx] pipeline split by parameters and measured time: parallel.cut_points={cuts} "
          f"(per stage: {'; '.join(shares)})", flush=True)   # rank 0 only (build_spec)
    return cuts


def check_pipeline(cfg: dict, graph, world_size: int) -> tuple:
    """With ``parallel.pipeline_stages`` S > 1: what the pipelined step supports so far, and the
    split itself (cut points, values that cannot cross a cut). Returns the data-parallel
    replicas (world size / S: the ranks the data is sharded over) and the graph one rank
    holds at most (the largest stage)."""
    par = cfg["parallel"]
    S = int(par["pipeline_stages"])
    if S == 1:
        if par["cut_points"]:
            raise ConfigError(f"parallel.cut_points={par['cut_points']} needs parallel.pipeline_stages > 1")
        return world_size, graph
    check_world(world_size, S)
    accumulate = int((cfg.get("train") or {}).get("accumulate") or 1)
    if accumulate > 1:
        # a pipeline already runs its batch as micro-batches, and accumulates their gradients
        raise ConfigError(f"train.accumulate={accumulate} applies to data-parallel steps; "
                          f"with parallel.pipeline_stages={S} the batch is already split into "
                          f"parallel.microbatches={par['microbatches']} accumulated micro-batches: raise "
                          f"that instead")
    policy = cfg["policy"]["name"]
    if not POLICIES[policy].steps_are_batches:     # the pipelined step is a synchronised step
        raise ConfigError(f"parallel.pipeline_stages={S} runs with policy=sync only; policy={policy} "
                          f"(local steps between syncs) is not designed for pipeline stages yet")
    dev = cfg["device"]
    if dev["kind"] != "cpu":
        raise ConfigError(f"parallel.pipeline_stages={S} runs on CPU lanes only for now (device=cpu, "
                          f"device.cpu_lanes=N), got device={dev['kind']}")
    if par["cut_points"] is None and par["balance"] == "time":
        par["cut_points"] = measured_cut_points(graph, S, cfg, world_size // S)
    stages = partition(graph, S, cut_points=par["cut_points"])
    for stage in stages:
        for name in stage.boundary_inputs:
            if stage.types[name].dtype != "float":
                raise ConfigError(f"parallel: '{name}' ({stage.types[name].dtype}) would cross into stage "
                                  f"{stage.index}; only floating-point values can cross a cut: move the "
                                  f"cut (parallel.cut_points)")
    return world_size // S, max(stages, key=lambda st: ParamLayout(st).size)


# what a builder of graph.models needs of the data's samples: (dimensions, what they are)
SAMPLE_DIMS = {"cnn": (3, "(C, H, W) images"), "transformer_lm": (1, "token sequences (N, T)")}


# rank 0: the ONNX file's initial weights, imported once by build_spec for initial_parameters
_IMPORTED: dict[str, dict] = {}


def _import_onnx(model_cfg: dict, info, inputs=None):
    """model=onnx: the file's graph with the loss head the config and the labels ask for."""
    path = model_cfg["path"]
    if not os.path.isfile(path):
        raise ConfigError(f"model.path={path}: no such file")
    label_dtype = "int64" if np.dtype(info.y_dtype).kind in "iub" else "float"
    imported = import_onnx(path, loss=model_cfg["loss"], label_dtype=label_dtype, label_shape=tuple(info.y_shape),
                           class_axis=model_cfg.get("class_axis"), inputs=inputs)
    for warning in imported.warnings:
        print(f"[hpc_rlx] warning: {path}: {warning}", flush=True)   # rank 0 only (build_spec)
    _IMPORTED[os.path.abspath(path)] = imported.initial
    return imported.graph


def _build_graph(model_cfg: dict, sample_shape: tuple, x_dtype: str, num_classes: int | None,
                 info=None, inputs=None):
    """The model graph: a builder of `graph.models.BUILDERS` with the option's keys
    (`config.schema.BUILDER_KEYS`) and what the data says, a graph file (`model=graph`) or an
    ONNX file (`model=onnx`; `inputs`: the packed model inputs of a `data.x` list)."""
    name = model_cfg["name"]
    if name in ("graph", "onnx") and model_cfg.get("path") in (None, "", "???"):
        raise ConfigError(f"model={name} needs model.path=<a {'graph JSON' if name == 'graph' else 'ONNX'} file>")
    if name == "graph":
        return Graph.from_file(model_cfg["path"])
    if name == "onnx":
        return _import_onnx(model_cfg, info, inputs)
    if name not in schema.BUILDER_KEYS:
        raise ConfigError(f"model={name!r} is not one of {', '.join(schema.MODELS)}")
    takes = inspect.signature(BUILDERS[name]).parameters
    if "input_shape" in takes and num_classes is None:
        raise DataError("cannot tell the number of classes: set model.num_classes, or give the "
                        "file or its label dataset a num_classes attribute")
    if name in SAMPLE_DIMS and len(sample_shape) != SAMPLE_DIMS[name][0]:
        raise DataError(f"model={name} needs {SAMPLE_DIMS[name][1]}; the data's samples have shape "
                        f"{tuple(sample_shape)}")
    kwargs = {k: model_cfg[k] for k in schema.BUILDER_KEYS[name]}
    if "input_shape" in takes:
        kwargs.update(input_shape=tuple(sample_shape), num_classes=num_classes)
    else:    # a sequence model: the classes are its vocabulary
        kwargs.update(vocab_size=num_classes, seq_len=int(sample_shape[0]))
    return with_config_keys("model", schema.BUILDER_KEYS[name], lambda: build_model(name, **kwargs))


def _num_classes(model_cfg: dict, info, n_train: int) -> int | None:
    n, source = num_classes(model_cfg, info, n_train)
    if n is not None and source.startswith("the training labels"):
        # rank 0 only (build_spec); every rank gets the number inside the spec
        print(f"[hpc_rlx] model.num_classes={n} from {source} of {info.path} "
              f"(set model.num_classes to choose it)", flush=True)
    return n


def build_spec(cfg: dict, run_dir: str, world_size: int, config_yaml: str = "",
               refusals: Callable[[dict, int], None] = lambda cfg, world_size: None) -> TrainSpec:
    """Rank 0: validate the config, inspect the data, build the graph and the shard plan; first,
    what the layers above refuse of the completed config (`resilience.mode.check_on_failure`)."""
    completed = validate_config(cfg, world_size)
    # of the config as composed (before the defaults are filled in): what rundirs sees
    fingerprint = fingerprint_of(cfg)
    cfg = completed
    refusals(cfg, world_size)
    spares = int(cfg["comm"]["spares"] or 0)
    world_size -= spares        # comm.spares wait to replace a dead rank: the data is planned over the others
    check_run_dir_writable(run_dir)
    d = cfg["data"]
    prepare_missing_data(d)
    src, inputs = input_sources(cfg)     # a file, a directory or a glob: the files and their counts
    info, vinfo, n_train, val_start, val_stop = src.info, src.vinfo, src.n_train, src.val_start, src.val_stop
    val_path = d["val_path"] or d["path"]

    n_classes = _num_classes(cfg["model"], info, n_train) if cfg["model"]["name"] in schema.BUILDER_KEYS else None
    graph = _build_graph(cfg["model"], info.x_shape, info.x_dtype, n_classes, info, inputs)
    graph = apply_loss_keys(graph, cfg["model"], int(cfg["parallel"]["pipeline_stages"]))
    graph = add_adapters(graph, lora_settings(cfg["model"]["lora"]))                  # model.lora.*
    graph = freeze_params(graph, cfg["model"]["freeze"], cfg["model"]["train_only"])   # model.freeze / train_only
    check_checkpoint_metric(cfg["checkpoint"]["metric"], graph)
    x_in, y_in = (next(i for i in graph.inputs if i.name == n) for n in ("x", "y"))
    expect = dict(input_shape=tuple(x_in.shape[1:]),
                  input_dtype_kind="int" if x_in.dtype == "int64" else "float",
                  label_kind="class" if y_in.dtype == "int64" else "float",
                  label_shape=tuple(y_in.shape[1:]))
    hdf5.check_compatible(info, **expect)
    if d["val_path"]:
        hdf5.check_compatible(vinfo, **expect)   # not only at the first validation, an epoch later

    replicas, held = check_pipeline(cfg, graph, world_size)
    check_shard(cfg)
    check_model_fits(held, cfg, world_size, "the model" if held is graph else
                     f"the largest of its {cfg['parallel']['pipeline_stages']} pipeline stages")
    # Fails here, on rank 0, with the same message every rank will print.
    plan = plan_shards(n_train, cfg["train"]["batch_size"], replicas, d["leftover"])
    if (d["cache"] == "stream" and d["distribution"] == "scatter"
            and not POLICIES[cfg["policy"]["name"]].steps_are_batches):
        # rank 0 streams rounds that every rank receives at the same step: lockstep policies only
        raise ConfigError(f"data.cache=stream with data.distribution=scatter needs every step to be "
                          f"a sync (policy=sync); policy={cfg['policy']['name']} lets ranks step apart: "
                          f"use data.distribution=read with data.cache=stream")
    check_optimizer(cfg["optim"], cfg["train"]["dtype"], cfg["train"]["epochs"] * plan.steps_per_epoch, graph)
    check_lane_batch(cfg["device"], cfg["train"]["batch_size"], replicas)
    check_accumulate(cfg["train"], replicas)

    init_from = cfg["model"]["init_from"]
    if init_from:
        source = {"kind": "file", "path": init_from}
    elif cfg["model"]["name"] == "onnx":
        source = {"kind": "onnx", "path": os.path.abspath(cfg["model"]["path"])}
    else:
        source = {"kind": "seed", "seed": int(cfg["train"]["seed"])}
    data_plan = DataPlan(
        path=d["path"], x=d["x"], y=d["y"], n_train=n_train, val_path=val_path,
        val_start=val_start, val_stop=val_stop, distribution=d["distribution"],
        leftover=d["leftover"], shuffle=bool(d["shuffle"]), check_finite=bool(d["check_finite"]),
        sample_shape=list(info.x_shape), x_dtype=str(info.x_dtype), y_dtype=str(info.y_dtype),
        cache=d["cache"], y_shape=list(info.y_shape), stage_dir=d.get("stage_dir"),
        stage_keep=bool(d.get("stage_keep")), files=src.files.pairs(), one_sample=src.files.one_sample,
        val_files=src.val_files.pairs() if src.val_files else None, inputs=inputs and [list(i) for i in inputs])
    return TrainSpec(
        graph=graph.to_dict(), param_source=source, data=data_plan, train=dict(cfg["train"]),
        optim=dict(cfg["optim"]), policy=dict(cfg["policy"]), device=dict(cfg["device"]),
        comm=dict(cfg["comm"]), checkpoint=dict(cfg["checkpoint"]), debug=dict(cfg["debug"]),
        report=dict(cfg["report"]), trace=dict(cfg["trace"]),
        run_dir=str(run_dir), resume=str(cfg["resume"]), world_size=world_size,
        config_yaml=config_yaml, parallel=dict(cfg["parallel"]),
        plan=_plan_line(plan, int(cfg["parallel"]["pipeline_stages"]), spares),
        config_fingerprint=fingerprint,
        model_source=source["path"] if source["kind"] == "onnx" else None,
        sync_batch_norm=check_sync_batch_norm(cfg, world_size))


def for_job_ranks(spec: TrainSpec, job_ranks: int, spares: int | None = None) -> TrainSpec:
    """`spec` for a job of `job_ranks` ranks (its survivors, after a rank died before training:
    comm.on_failure), with `spares` spare ranks left (None: as before): the ranks that train and
    the plan's line for them; the data, the batch and everything else unchanged."""
    c = spec.comm if spares is None else dict(spec.comm, spares=spares)
    world = job_ranks - int(c.get("spares") or 0)
    plan = plan_shards(spec.data.n_train, spec.train["batch_size"], world, spec.data.leftover)
    return replace(spec, comm=c, world_size=world,
                   plan=_plan_line(plan, int(spec.parallel["pipeline_stages"]), job_ranks - world))


def _plan_line(plan, stages: int, spares: int) -> str:
    """The start-up line of the data plan, and of the spare ranks beside it."""
    return plan.describe(stages) + (f", and {spares} spare rank(s)" if spares else "")


def initial_parameters(spec: TrainSpec, graph, layout) -> np.ndarray:
    """Rank 0: the initial flat parameter vector, in the compute dtype."""
    dtype = np.dtype(spec.train["dtype"])
    flat = np.zeros(layout.size, dtype=np.float64)
    src = spec.param_source
    if src["kind"] == "seed":
        init_params(graph, flat, int(src["seed"]))
    elif src["kind"] == "onnx":
        initial = _IMPORTED.get(src["path"])
        if initial is None:     # build_spec ran in another process (a test, a tool)
            initial = import_onnx(src["path"]).initial
        layout.pack({**initial, **initial_adapters(graph, int(spec.train["seed"]))}, flat)
    else:
        try:
            with h5py.File(src["path"], "r") as f:
                views = layout.views(flat)
                for p in graph.params:
                    if p.name not in f and p.name in adapter_ir_names(graph.meta):
                        raise ConfigError(f"model.init_from={src['path']} holds no LoRA adapters (no dataset "
                                          f"{p.name!r}) and model.lora.rank adds them: start from a run trained "
                                          f"with these model.lora keys, or from base weights in an ONNX file")
                    if p.name not in f:
                        raise ConfigError(f"model.init_from={src['path']} has no dataset {p.name!r}")
                    arr = f[p.name][...]
                    if tuple(arr.shape) != tuple(p.shape):
                        raise ConfigError(f"model.init_from={src['path']}: {p.name} has shape "
                                          f"{arr.shape}, the model needs {tuple(p.shape)}")
                    views[p.name][...] = arr
        except OSError as e:
            raise ConfigError(f"model.init_from={src['path']} cannot be read: {e}") from e
    return flat.astype(dtype)
