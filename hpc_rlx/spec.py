"""The TrainSpec: everything a worker needs to train a model it has no code for.

Rank 0 turns the composed Hydra config into a TrainSpec (`build_spec`), which is a few KB of
plain JSON-able data and is broadcast to every rank. Parameter values are *not* in the
spec: rank 0 materialises them (`initial_parameters`) and broadcasts them by buffer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError, DataError

DTYPES = ("float32", "float64")
DEVICES = ("cpu", "cuda", "all", "auto")
DISTRIBUTIONS = ("read", "scatter")
ON_NONFINITE = ("stop", "skip")
CKPT_METRICS = ("val_loss", "val_accuracy")


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


@dataclass
class TrainSpec:
    graph: dict                  # the model graph IR (hpc_rlx.graph JSON form)
    param_source: dict           # {"kind": "seed", "seed": s} or {"kind": "file", "path": p}
    data: DataPlan
    train: dict
    optim: dict
    policy: dict
    device: dict
    comm: dict
    checkpoint: dict
    debug: dict
    run_dir: str
    resume: str
    world_size: int
    config_yaml: str = ""
    extras: dict = field(default_factory=dict)   # report/trace switches

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSpec":
        d = dict(d)
        d["data"] = DataPlan(**d["data"])
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    """A finite real number (bools, strings, NaN and Inf are not)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_config(cfg: dict, world_size: int | None = None) -> None:
    """Value checks Hydra's schema cannot express. Every message names the key and value.

    Type-safe on purpose: any value a command line can produce gives a ConfigError, never a
    TypeError from comparing it.
    """
    t, o, c, dev, ck = cfg["train"], cfg["optim"], cfg["comm"], cfg["device"], cfg["checkpoint"]
    _require(_int(t["epochs"]) and t["epochs"] >= 1,
             f"train.epochs must be a positive integer, got {t['epochs']!r}")
    _require(_int(t["batch_size"]) and t["batch_size"] >= 1,
             f"train.batch_size must be a positive integer, got {t['batch_size']!r}")
    _require(t["dtype"] in DTYPES, f"train.dtype={t['dtype']!r} is not one of {DTYPES}")
    _require(t["on_nonfinite"] in ON_NONFINITE,
             f"train.on_nonfinite={t['on_nonfinite']!r} is not one of {ON_NONFINITE}")
    _require(t.get("progress", "auto") in ("auto", "bar", "lines"),
             f"train.progress={t.get('progress')!r} is not one of ('auto', 'bar', 'lines')")
    les = t.get("log_every_s")
    _require(les is None or (_num(les) and les >= 0),
             f"train.log_every_s must be null or a number >= 0, got {les!r}")
    from .tensorboard_log import enabled as tensorboard_enabled
    tensorboard_enabled(cfg.get("report", {}).get("tensorboard", "auto"))   # a bad value or a missing library
    tpr = t.get("threads_per_rank")
    _require(tpr is None or (isinstance(tpr, int) and not isinstance(tpr, bool) and tpr >= 1),
             f"train.threads_per_rank must be null or an integer >= 1, got {tpr!r}")
    mcs = t.get("max_consecutive_skips")
    _require(mcs is None or (isinstance(mcs, int) and not isinstance(mcs, bool) and mcs >= 0),
             f"train.max_consecutive_skips must be an integer >= 0, got {mcs!r}")
    _require(t["max_steps"] is None or (_int(t["max_steps"]) and t["max_steps"] >= 1),
             f"train.max_steps must be null or a positive integer, got {t['max_steps']!r}")
    _require(_int(t.get("seed", 0)) and t.get("seed", 0) >= 0,
             f"train.seed must be an integer >= 0, got {t.get('seed')!r}")
    lr = o["lr"]
    _require(_num(lr) and lr > 0, f"optim.lr must be a positive number, got {lr!r}")
    ratio = o.get("lr_scale_ratio", 0.0)
    _require(ratio is None or (_num(ratio) and ratio >= 0),
             f"optim.lr_scale_ratio must be >= 0, got {ratio!r}")
    if o.get("clip_grad_norm") is not None:
        _require(_num(o["clip_grad_norm"]) and o["clip_grad_norm"] > 0,
                 f"optim.clip_grad_norm must be null or > 0, got {o['clip_grad_norm']!r}")
    for key in ("momentum", "weight_decay", "eps", "min_lr", "gamma"):
        if key in o and o[key] is not None:
            _require(_num(o[key]) and o[key] >= 0, f"optim.{key} must be a number >= 0, got {o[key]!r}")
    for key in ("warmup_steps", "step_size"):
        if key in o and o[key] is not None:
            _require(_int(o[key]) and o[key] >= 0, f"optim.{key} must be an integer >= 0, got {o[key]!r}")
    _require(dev["kind"] in DEVICES, f"device={dev['kind']!r} is not one of {DEVICES}")
    _require(_int(dev["cpu_lanes"]) and dev["cpu_lanes"] >= 0,
             f"device.cpu_lanes must be an integer >= 0, got {dev['cpu_lanes']!r}")
    _require(dev["kind"] not in ("cpu",) or dev["cpu_lanes"] >= 1,
             "device=cpu needs device.cpu_lanes >= 1")
    _require(_num(c["bucket_cap_mb"]) and c["bucket_cap_mb"] > 0,
             f"comm.bucket_cap_mb must be > 0, got {c['bucket_cap_mb']!r}")
    warn, stall_abort = c.get("stall_warning_s"), c.get("stall_abort_s")
    _require(warn is None or (_num(warn) and warn >= 0),
             f"comm.stall_warning_s must be null (off) or a number of seconds >= 0, got {warn!r}")
    _require(stall_abort is None or stall_abort == "auto" or (_num(stall_abort) and stall_abort > 0),
             f"comm.stall_abort_s must be auto, null (never) or a number of seconds > 0, got {stall_abort!r}")
    _require(stall_abort in (None, "auto") or (_num(warn) and warn > 0),
             f"comm.stall_abort_s={stall_abort!r} needs the watchdog on: comm.stall_warning_s > 0, "
             f"got {warn!r}")
    _require(cfg["data"]["distribution"] in DISTRIBUTIONS,
             f"data.distribution={cfg['data']['distribution']!r} is not one of {DISTRIBUTIONS}")
    vf = cfg["data"]["val_fraction"]
    _require(vf is None or (_num(vf) and 0 <= vf < 1), f"data.val_fraction must be in [0, 1), got {vf!r}")
    for key in ("x", "y"):
        _require(isinstance(cfg["data"][key], str) and cfg["data"][key] != "",
                 f"data.{key} must be a dataset name, got {cfg['data'][key]!r}")
    _require(ck["metric"] in CKPT_METRICS,
             f"checkpoint.metric={ck['metric']!r} is not one of {CKPT_METRICS}")
    _require(_int(ck["keep_last"]) and ck["keep_last"] >= 1,
             f"checkpoint.keep_last must be >= 1, got {ck['keep_last']!r}")
    for key in ("every_steps", "every_epochs"):
        v = ck[key]
        _require(v is None or (_int(v) and v > 0), f"checkpoint.{key} must be null or an integer > 0, got {v!r}")
    v = ck["every_minutes"]
    _require(v is None or (_num(v) and v > 0), f"checkpoint.every_minutes must be null or > 0, got {v!r}")
    from .policies import parse_slowdown, validate_policy_config
    validate_policy_config(cfg["policy"])
    parse_slowdown(cfg["debug"].get("slowdown"), world_size)


def check_lane_batch(dev: dict, global_batch: int, world_size: int) -> None:
    """Every lane needs at least one sample per step, or the ranks x lanes asked for are not
    all used. Checked where the lane count is known before the run (device=cpu / cuda)."""
    kind = dev.get("kind")
    key = {"cpu": "cpu_lanes", "cuda": "gpus_per_rank"}.get(kind)
    lanes = dev.get(key) if key else None
    if not isinstance(lanes, int) or lanes <= 1:
        return
    per_rank = global_batch // world_size
    if per_rank < lanes:
        raise ConfigError(
            f"train.batch_size={global_batch} over {world_size} ranks gives a rank {per_rank} "
            f"sample(s) per step, fewer than its {lanes} lanes (device.{key}={lanes}); use "
            f"train.batch_size >= {world_size * lanes} (ranks x lanes) or fewer lanes")


def optimizer_kwargs(opt: dict) -> dict:
    """The optimizer's own keys from the `optim` group (the rest are schedule/scaling keys)."""
    if opt["name"] == "sgd":
        return dict(momentum=opt["momentum"], nesterov=opt["nesterov"], weight_decay=opt["weight_decay"])
    if opt["name"] == "adamw":
        return dict(betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=opt["weight_decay"])
    return {}


def schedule_kwargs(opt: dict) -> dict:
    return dict(warmup_steps=opt.get("warmup_steps", 0), step_size=opt.get("step_size"),
                gamma=opt.get("gamma", 0.1), min_lr=opt.get("min_lr", 0.0))


def check_optimizer(opt: dict, dtype: str, schedule_steps: int) -> None:
    """Build the optimizer and schedule once on rank 0, so bad values are one clear startup
    error instead of a failure on every rank later."""
    from .optim import make_optimizer, make_schedule

    try:
        make_optimizer(opt["name"], 1, np, np.dtype(dtype), **optimizer_kwargs(opt))
        make_schedule(opt["schedule"], float(opt["lr"]), schedule_steps, **schedule_kwargs(opt))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"optim: {e}") from e


def check_model_fits(graph, cfg: dict, world_size: int) -> None:
    """Refuse, once and clearly, a model whose parameter-sized buffers cannot fit in this node's
    memory (instead of every rank dying in its own allocation)."""
    from .graph import ParamLayout

    n = ParamLayout(graph).size
    itemsize = np.dtype(cfg["train"]["dtype"]).itemsize
    # params, gradient bucket, init buffer (float64), optimizer state, one per extra CPU lane
    copies = 4 + (2 if cfg["optim"]["name"] == "adamw" else 1) + max(0, cfg["device"]["cpu_lanes"] - 1)
    need = n * itemsize * copies + n * 8
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if need > avail:
        raise ConfigError(f"the model has {n:,} parameters: about {need / 2**30:.1f} GiB of parameter-sized "
                          f"buffers per rank, more than the {avail / 2**30:.1f} GiB of memory available "
                          f"on this node; use a smaller model")


def check_run_dir_writable(run_dir: str) -> None:
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run directory {run_dir} is not writable: {e.strerror or e}") from e


def _build_graph(model_cfg: dict, sample_shape: tuple, x_dtype: str, num_classes: int | None):
    from .graph import Graph, build_model

    name = model_cfg["name"]
    if name == "graph":
        if model_cfg.get("path") in (None, "", "???"):
            raise ConfigError("model=graph needs model.path=<a graph JSON file>")
        return Graph.from_file(model_cfg["path"])
    if name in ("mlp", "cnn") and num_classes is None:
        raise DataError("cannot tell the number of classes: set model.num_classes, or give the "
                        "file or its label dataset a num_classes attribute")
    if name == "mlp":
        return build_model("mlp", input_shape=tuple(sample_shape), num_classes=num_classes,
                           hidden=model_cfg["hidden"], activation=model_cfg["activation"],
                           dropout=model_cfg["dropout"])
    if name == "cnn":
        if len(sample_shape) != 3:
            raise DataError(f"model=cnn needs (C, H, W) images; the data's samples have shape "
                            f"{tuple(sample_shape)}")
        return build_model("cnn", input_shape=tuple(sample_shape), num_classes=num_classes,
                           channels=model_cfg["channels"], kernel=model_cfg["kernel"],
                           hidden=model_cfg["hidden"], pool=model_cfg["pool"],
                           dropout=model_cfg["dropout"])
    if name == "transformer_lm":
        if len(sample_shape) != 1:
            raise DataError(f"model=transformer_lm needs token sequences (N, T); the data's "
                            f"samples have shape {tuple(sample_shape)}")
        return build_model("transformer_lm", vocab_size=num_classes, seq_len=int(sample_shape[0]),
                           d_model=model_cfg["d_model"], n_heads=model_cfg["n_heads"],
                           n_layers=model_cfg["n_layers"], d_ff=model_cfg["d_ff"],
                           dropout=model_cfg.get("dropout", 0.0))
    raise ConfigError(f"model={name!r} is not one of mlp, cnn, transformer_lm, graph")


def _num_classes(model_cfg: dict, info, n_train: int) -> int | None:
    from .data.resolve import num_classes

    n, source = num_classes(model_cfg, info, n_train)
    if n is not None and source.startswith("the training labels"):
        # rank 0 only (build_spec); every rank gets the number inside the spec
        print(f"[hpc_rlx] model.num_classes={n} from {source} of {info.path} "
              f"(set model.num_classes to choose it)", flush=True)
    return n


def build_spec(cfg: dict, run_dir: str, world_size: int, config_yaml: str = "") -> TrainSpec:
    """Rank 0: validate the config, inspect the data, build the graph and the shard plan."""
    from .data import hdf5
    from .data.plan import plan_shards
    from .rundirs import fingerprint_of

    validate_config(cfg, world_size)
    # of the config as composed (before anything below fills in defaults): what rundirs sees
    fingerprint = fingerprint_of(cfg)
    check_run_dir_writable(run_dir)
    d = cfg["data"]
    from .data.resolve import prepare_missing_data
    prepare_missing_data(d)
    info = hdf5.describe(d["path"], d["x"], d["y"])

    if d.get("val_path"):
        vinfo = hdf5.describe(d["val_path"], d["x"], d["y"])
        n_train, val_path, val_start, val_stop = info.n, d["val_path"], 0, vinfo.n
    else:
        n_val = int(round(info.n * float(d["val_fraction"] or 0.0)))
        n_train = info.n - n_val
        val_path, val_start, val_stop = d["path"], n_train, info.n
        if n_train <= 0:
            raise DataError(f"data.val_fraction={d['val_fraction']} leaves no training samples "
                            f"in {d['path']} ({info.n} samples)")

    graph = _build_graph(cfg["model"], info.x_shape, info.x_dtype, _num_classes(cfg["model"], info, n_train))
    if cfg["checkpoint"]["metric"] == "val_accuracy" and "correct" not in graph.outputs:
        raise ConfigError("checkpoint.metric=val_accuracy, but this model reports no accuracy "
                          "(its loss is a regression loss); use checkpoint.metric=val_loss")
    x_in = next(i for i in graph.inputs if i.name == "x")
    y_in = next(i for i in graph.inputs if i.name == "y")
    expect = dict(input_shape=tuple(x_in.shape[1:]),
                  input_dtype_kind="int" if x_in.dtype == "int64" else "float",
                  label_kind="class" if y_in.dtype == "int64" else "float",
                  label_shape=tuple(y_in.shape[1:]))
    hdf5.check_compatible(info, **expect)
    if d.get("val_path"):
        hdf5.check_compatible(vinfo, **expect)   # not only at the first validation, an epoch later

    check_model_fits(graph, cfg, world_size)
    # Fails here, on rank 0, with the same message every rank will print.
    plan = plan_shards(n_train, cfg["train"]["batch_size"], world_size, d["leftover"])
    check_optimizer(cfg["optim"], cfg["train"]["dtype"], cfg["train"]["epochs"] * plan.steps_per_epoch)
    check_lane_batch(cfg["device"], cfg["train"]["batch_size"], world_size)

    init_from = cfg["model"].get("init_from")
    source = ({"kind": "file", "path": init_from} if init_from
              else {"kind": "seed", "seed": int(cfg["train"]["seed"])})
    data_plan = DataPlan(
        path=d["path"], x=d["x"], y=d["y"], n_train=n_train, val_path=val_path,
        val_start=val_start, val_stop=val_stop, distribution=d["distribution"],
        leftover=d["leftover"], shuffle=bool(d["shuffle"]), check_finite=bool(d["check_finite"]),
        sample_shape=list(info.x_shape), x_dtype=str(info.x_dtype), y_dtype=str(info.y_dtype))
    return TrainSpec(
        graph=graph.to_dict(), param_source=source, data=data_plan, train=dict(cfg["train"]),
        optim=dict(cfg["optim"]), policy=dict(cfg["policy"]), device=dict(cfg["device"]),
        comm=dict(cfg["comm"]), checkpoint=dict(cfg["checkpoint"]), debug=dict(cfg["debug"]),
        run_dir=str(run_dir), resume=str(cfg["resume"]), world_size=world_size,
        config_yaml=config_yaml,
        extras={"report": dict(cfg.get("report", {})), "trace": dict(cfg.get("trace", {})),
                "plan": plan.describe(), "config_fingerprint": fingerprint})


def initial_parameters(spec: TrainSpec, graph, layout) -> np.ndarray:
    """Rank 0: the initial flat parameter vector, in the compute dtype."""
    from .graph import init_params

    dtype = np.dtype(spec.train["dtype"])
    flat = np.zeros(layout.size, dtype=np.float64)
    src = spec.param_source
    if src["kind"] == "seed":
        init_params(graph, flat, int(src["seed"]))
    else:
        import h5py
        try:
            with h5py.File(src["path"], "r") as f:
                views = layout.views(flat)
                for p in graph.params:
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
