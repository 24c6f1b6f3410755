"""Bad input, one table: every case is ONE clear error, the same on every rank, a non-zero exit
well inside the timeout, and no file written or damaged. Every case runs under `mpirun -n 2`.

"The same on every rank" is what exit status 2 proves: it is the agreed-error path, taken only
when every rank raised the same error; a rank that disagreed would take the abort path (exit 1,
"aborting all") and a rank left waiting would hit the timeout.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pytest

from tests.support.jobs import REPO, explain, launch_cmd, mpi_env, train_job

# the module's fixture runs its jobs once: its tests keep to one pytest-xdist worker
pytestmark = [pytest.mark.mpi, pytest.mark.xdist_group("bad-inputs-source")]

N, FEATURES, CLASSES = 120, 6, 3
TIMEOUT = 60
SMALL = ["train.epochs=1", "train.batch_size=8", "model.hidden=[8]"]


# --------------------------------------------------------------------------------------
# Inputs: one tiny dataset and its broken variants, graph files, checkpoints
# --------------------------------------------------------------------------------------

def _write(path: Path, x, y, num_classes=CLASSES) -> Path:
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = y
        if num_classes is not None:
            f.attrs["num_classes"] = num_classes
    return path


def _good_xy():
    rng = np.random.default_rng(0)
    return rng.standard_normal((N, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, N).astype(np.int64)


def _mlp_graph(features: int):
    from hpc_rlx.graph import build_model
    return build_model("mlp", input_shape=(features,), num_classes=CLASSES, hidden=[8])


def _make_inputs(root: Path) -> dict:
    x, y = _good_xy()
    p = {"good": _write(root / "good.h5", x, y)}
    p["empty"] = _write(root / "empty.h5", x[:0], y[:0])
    # many files as one set (data.path a directory or a glob)
    (root / "empty_dir").mkdir()
    p["empty_dir"] = root / "empty_dir"
    p["no_match"] = root / "nothing_*.h5"
    (root / "mixed_dir").mkdir()
    _write(root / "mixed_dir" / "part_0.h5", x[:60], y[:60])
    _write(root / "mixed_dir" / "part_1.h5", x[60:, :-1], y[60:])      # one feature short
    p["mixed_dir"] = root / "mixed_dir"
    p["float_labels"] = _write(root / "float_labels.h5", x, y.astype(np.float32))
    bad = y.copy()
    bad[10] = CLASSES + 4
    p["label_range"] = _write(root / "label_range.h5", x, bad)
    xn = x.copy()
    xn[7, 2] = np.nan
    p["nan"] = _write(root / "nan.h5", xn, y)
    p["tiny"] = _write(root / "tiny.h5", x[:1], y[:1])
    p["not_h5"] = root / "not_hdf5.h5"
    p["not_h5"].write_text("x,y\n1,2\n")
    p["a_file"] = root / "plain_file"
    p["a_file"].write_text("not a directory\n")

    good = _mlp_graph(FEATURES).to_dict()
    (root / "graph_good.json").write_text(json.dumps(good))
    p["graph_good"] = root / "graph_good.json"
    p["graph_narrow"] = root / "graph_narrow.json"           # expects 5 features, the data has 6
    _mlp_graph(FEATURES - 1).to_file(p["graph_narrow"])
    unknown = json.loads(json.dumps(good))
    unknown["nodes"][0]["op"] = "conv9d"
    p["graph_unknown_op"] = root / "graph_unknown_op.json"
    p["graph_unknown_op"].write_text(json.dumps(unknown))
    p["graph_malformed"] = root / "graph_malformed.json"
    p["graph_malformed"].write_text(json.dumps(good)[:-40])
    mism = json.loads(json.dumps(good))
    first_param = mism["params"][0]
    first_param["shape"] = [first_param["shape"][0] + 3] + first_param["shape"][1:]
    p["graph_shape"] = root / "graph_shape.json"
    p["graph_shape"].write_text(json.dumps(mism))
    cyc = json.loads(json.dumps(good))
    names = [n["name"] for n in cyc["nodes"]]
    cyc["nodes"][0]["inputs"] = [names[1] if i == 0 else r for i, r in enumerate(cyc["nodes"][0]["inputs"])]
    p["graph_cycle"] = root / "graph_cycle.json"
    p["graph_cycle"].write_text(json.dumps(cyc))
    return p


def _hash_tree(d: Path) -> dict:
    if not d.exists():
        return {}
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _make_inputs(tmp_path_factory.mktemp("bad_inputs"))


@pytest.fixture(scope="module")
def source_run(tmp_path_factory, inputs):
    """A real finished run of the tiny model: its checkpoints are copied into cases' run dirs."""
    run = tmp_path_factory.mktemp("source") / "run"
    proc = train_job(2, run, ["data=file", f"data.path={inputs['good']}", *SMALL], timeout=TIMEOUT)
    assert proc.returncode == 0, explain(proc)
    ckpts = sorted((run / "checkpoints").glob("ckpt-*.h5"))
    assert ckpts, explain(proc)
    return run


# --------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    id: str
    overrides: tuple          # "{name}" is replaced by the path of input `name`
    expect: str               # regex the one error line must match
    kind: str = "DataError"   # the kind in "hpc_rlx: error (<kind>, ..."
    data: str | None = "good"  # data=file with this input (None: the overrides choose)
    seed_run: bool = False    # run dir starts with a copy of source_run's checkpoints
    corrupt: str | None = None  # "truncate" | "flip": damage a copy of the newest checkpoint
    file_limit_kb: int | None = None  # RLIMIT_FSIZE for every rank (a full disk)
    skip_with_gpu: bool = False
    extra_files_ok: tuple = field(default_factory=tuple)


CASES = [
    # ---- data file
    Case("missing_file", ("data.path={good}.missing",), r"dataset file '.*good\.h5\.missing' does not exist", data=None),
    Case("missing_dataset", ("data.x=inputs",), r"has no input dataset 'inputs'; datasets in the file: \['x', 'y'\]"),
    Case("empty_dataset", (), r"dataset 'x' in '.*empty\.h5' is empty \(shape \(0, 6\)\)", data="empty"),
    Case("input_shape_vs_model", ("model=graph", "model.path={graph_narrow}"),
         r"per-sample input shape of 'x' is \(6,\), but the model expects \(5,\)"),
    Case("float_labels", (), r"labels 'y' have dtype float32, but the loss needs integer class indices",
         data="float_labels"),
    Case("labels_out_of_range", (), r"label 7 at row 10 is outside \[0, 3\) for num_classes=3",
         data="label_range"),
    Case("class_weights_length", ("model.class_weights=[1.0,2.0]",),
         r"model.class_weights has 2 weights, but the model has 3 classes", kind="ConfigError"),
    Case("nan_inputs_checked", ("data.check_finite=true",), r"input row 7 contains a non-finite value \(nan\)",
         data="nan"),
    Case("not_hdf5", (), r"dataset file '.*not_hdf5\.h5' is not an HDF5 file", data="not_h5"),
    Case("empty_directory", (), r"data\.path=.*empty_dir is a directory with no files in it", data="empty_dir"),
    Case("glob_matching_nothing", (), r"data\.path=.*nothing_\*\.h5 matches no file", data="no_match"),
    Case("a_file_of_the_set_with_another_shape", (),
         r"data file '.*part_1\.h5' differs from '.*part_0\.h5': input 'x' has per-sample shape \(5,\) there, "
         r"\(6,\) in", data="mixed_dir"),
    # ---- sizes
    Case("fewer_samples_than_ranks", ("data.val_fraction=0", "train.batch_size=1"),
         r"more ranks \(2\) than training samples \(1\)", kind="ConfigError", data="tiny"),
    Case("fewer_samples_than_ranks_x_lanes", ("device.cpu_lanes=3", "train.batch_size=4"),
         r"train\.batch_size=4 over 2 ranks gives a rank 2 sample\(s\) per step, fewer than its 3 lanes",
         kind="ConfigError"),
    Case("batch_zero", ("train.batch_size=0",), r"train\.batch_size must be a positive integer, got 0",
         kind="ConfigError"),
    Case("batch_negative", ("train.batch_size=-8",), r"train\.batch_size must be a positive integer, got -8",
         kind="ConfigError"),
    Case("batch_larger_than_data", ("train.batch_size=5000",),
         r"train\.batch_size=5000 is larger than the training set \(96 samples\)", kind="ConfigError"),
    # ---- config
    Case("unknown_key", ("train.epochz=3",),
         r"unknown config key 'train\.epochz' \(from 'train\.epochz=3'\); did you mean 'train\.epochs'\?",
         kind="ConfigError"),
    Case("added_key", ("+train.warmup=3",), r"unknown config key 'train\.warmup'", kind="ConfigError"),
    Case("unknown_group_option", ("optim=adamm",),
         r"unknown option 'adamm' for config group 'optim' \(optim=adamm\); available: adamw, lamb, lars, lion, sgd",
         kind="ConfigError"),
    Case("negative_lr", ("optim.lr=-0.1",), r"optim\.lr must be a positive number, got -0\.1", kind="ConfigError"),
    # values that would run as if unset (the whole check: tests/unit/config/test_meaningless_values.py)
    Case("accumulate_above_samples_per_rank", ("train.accumulate=1000",),
         r"train\.accumulate=1000 is more micro-batches than the \d+ sample\(s\) a rank takes per step .* the "
         r"largest value that means something is \d+", kind="ConfigError"),
    Case("unknown_fail_point", ("debug.fail_point=finsh", "debug.fail_rank=1"),
         r"debug\.fail_point must be null or one of spec, .*finish, got 'finsh'", kind="ConfigError"),
    Case("fail_rank_outside_the_world", ("debug.fail_rank=7", "debug.fail_point=step"),
         r"debug\.fail_rank=7 names a rank outside the world of 2 \(the largest rank is 1\)", kind="ConfigError"),
    Case("nesterov_without_momentum", ("optim.nesterov=true", "optim.momentum=0"),
         r"nesterov=true needs momentum > 0", kind="ConfigError"),
    Case("momentum_out_of_range", ("optim.momentum=1.5",), r"momentum must be a number in \[0, 1\), got 1\.5",
         kind="ConfigError"),
    Case("step_schedule_without_step_size", ("optim.schedule=step", "optim.step_size=0"),
         r"step_size must be an integer >= 1, got 0", kind="ConfigError"),
    Case("warmup_longer_than_training", ("optim.warmup_steps=100000",),
         r"warmup_steps \(100000\) is more than total_steps", kind="ConfigError"),
    Case("negative_seed", ("train.seed=-1",), r"train\.seed must be an integer >= 0, got -1", kind="ConfigError"),
    Case("seed_beyond_64_bits", ("train.seed=99999999999999999999",),
         r"train\.seed must be at most 2\*\*63 - 1 \(9223372036854775807\), got 99999999999999999999",
         kind="ConfigError"),
    Case("accumulate_with_pipeline_stages", ("parallel.pipeline_stages=2", "train.accumulate=2"),
         r"train\.accumulate=2 applies to data-parallel steps; with parallel\.pipeline_stages=2 the batch is "
         r"already split into parallel\.microbatches=4", kind="ConfigError"),
    Case("accumulate_zero", ("train.accumulate=0",), r"train\.accumulate must be a positive integer, got 0",
         kind="ConfigError"),
    Case("shard_with_cadence", ("policy=cadence", "comm.shard=optimizer"),
         r"comm\.shard=optimizer does not run with policy=cadence: its ranks hold different parameters "
         r"between syncs", kind="ConfigError"),
    Case("shard_unknown", ("comm.shard=params",), r"comm\.shard='params' is not one of", kind="ConfigError"),
    Case("node_shared_params_without_shard", ("comm.node_shared_params=true",),
         r"comm\.node_shared_params=true does not run with comm\.shard=none: each rank would step all of "
         r"the node's one copy; set comm\.shard=optimizer", kind="ConfigError"),
    Case("node_shared_params_with_the_16_bit_wire",
         ("comm.node_shared_params=true", "comm.shard=optimizer", "comm.wire_dtype=bfloat16"),
         r"comm\.node_shared_params=true does not run with comm\.wire_dtype=bfloat16", kind="ConfigError"),
    # ---- comm.on_failure (a dead rank): shrink needs ULFM, and runs with some settings only so far
    Case("on_failure_unknown", ("comm.on_failure=restart",), r"comm\.on_failure='restart' is not one of",
         kind="ConfigError"),
    Case("shrink_without_ulfm", ("comm.on_failure=shrink",),
         r"comm\.on_failure=shrink needs MPI's fault tolerance \(ULFM\), which this job does not have: the "
         r"MPI library \(MPICH.*\) has no ULFM in mpi4py.*; launch with Open MPI 5's `mpirun --with-ft ulfm "
         r"-n N python -m hpc_rlx comm\.on_failure=shrink`, or use comm\.on_failure=abort", kind="ConfigError"),
    Case("spare_without_ulfm", ("comm.on_failure=spare", "comm.spares=1"),
         r"comm\.on_failure=spare needs MPI's fault tolerance \(ULFM\), which this job does not have: the "
         r"MPI library \(MPICH.*\) has no ULFM in mpi4py", kind="ConfigError"),
    Case("spares_leave_no_rank_to_train", ("comm.on_failure=spare", "comm.spares=2"),
         r"comm\.spares=2 leaves no rank to train on 2 ranks: launch 2 more than the ranks that train",
         kind="ConfigError"),
    Case("spares_without_spare", ("comm.spares=2",),
         r"comm\.spares=2 applies to comm\.on_failure=spare, got comm\.on_failure=abort", kind="ConfigError"),
    Case("shrink_with_pipeline_stages", ("comm.on_failure=shrink", "parallel.pipeline_stages=2"),
         r"comm\.on_failure=shrink does not run with parallel\.pipeline_stages=2: a dead rank takes a "
         r"stage's only copy with it", kind="ConfigError"),
    Case("spare_with_cadence", ("comm.on_failure=spare", "comm.spares=1", "policy=cadence"),
         r"comm\.on_failure=spare does not run with policy=cadence without policy\.reset_inner=true: a rank's "
         r"inner optimizer state is its own \(local steps\), and a spare cannot hold the dead rank's; set "
         r"policy\.reset_inner=true", kind="ConfigError"),
    Case("shrink_with_streaming_outer_syncs", ("comm.on_failure=shrink", "policy=async", "policy.tune=false",
                                               "policy.anchor=4", "policy.fragments=2"),
         r"comm\.on_failure=shrink does not run with policy\.fragments / policy\.fragment_delay \(streaming outer "
         r"syncs\): the fragments in flight are not dropped over the survivors", kind="ConfigError"),
    Case("fragments_with_cadence", ("policy=cadence", "policy.fragments=2"),
         r"policy\.fragments=2 policy\.fragment_delay=0 needs every rank on the same steps per sync: use "
         r"policy=async with policy\.tune=false", kind="ConfigError"),
    Case("shrink_with_gpu_lanes", ("comm.on_failure=shrink", "device=cuda"),
         r"comm\.on_failure=shrink does not run with device=cuda: GPU lanes are not rebuilt after a failure "
         r"yet; use device=cpu", kind="ConfigError"),
    Case("shrink_with_shard", ("comm.on_failure=shrink", "comm.shard=optimizer"),
         r"comm\.on_failure=shrink does not run with comm\.shard=optimizer: a rank holds the only copy",
         kind="ConfigError"),
    Case("shrink_with_node_shared_params",
         ("comm.on_failure=shrink", "comm.shard=optimizer", "comm.node_shared_params=true"),
         r"comm\.on_failure=shrink does not run with comm\.node_shared_params=true", kind="ConfigError"),
    Case("eval_batch_size_zero", ("train.eval_batch_size=0",),
         r"train\.eval_batch_size must be null or an integer >= 1, got 0", kind="ConfigError"),
    Case("graph_without_path", ("model=graph",), r"model=graph needs model\.path", kind="ConfigError"),
    Case("model_too_large_for_memory", ("model.hidden=[1000000000]",),
         r"the model has [\d,]+ parameters: about [\d.]+ GiB .* more than the", kind="ConfigError"),
    Case("unknown_device_option", ("device=tpu",), r"unknown option 'tpu' for config group 'device'",
         kind="ConfigError"),
    Case("unknown_device_kind", ("device.kind=tpu",), r"device='tpu' is not one of", kind="ConfigError"),
    Case("cuda_without_gpu", ("device=cuda",), r"device=cuda but no GPU is usable on this rank",
         kind="DeviceError", skip_with_gpu=True),
    Case("unwritable_run_dir", ("hydra.run.dir={a_file}/run",), r"run directory .*plain_file/run is not writable",
         kind="ConfigError"),
    # ---- frozen parameters (model.freeze, model.train_only)
    Case("freeze_and_train_only", ("model.freeze=[fc0.*]", "model.train_only=[head.*]"),
         r"model\.freeze=\['fc0\.\*'\] and model\.train_only=\['head\.\*'\] are both set: set one",
         kind="ConfigError"),
    Case("freeze_glob_matching_nothing", ("model.freeze=[fc0.wieght]",),
         r"model\.freeze: 'fc0\.wieght' matches no trainable parameter; the closest names: 'fc0\.weight', .*"
         r"\(4 in all\)", kind="ConfigError"),
    Case("freeze_leaving_nothing_to_train", ("model.freeze=[fc0.*,head.*]",),
         r"model\.freeze=\['fc0\.\*', 'head\.\*'\] freezes every trainable parameter \(fc0\.weight, fc0\.bias, "
         r"head\.weight, head\.bias\), which leaves nothing to train", kind="ConfigError"),
    # ---- LoRA adapters (model.lora.*)
    Case("lora_targets_not_2d_weights", ("model.lora.rank=2", "model.lora.targets=[*bias]"),
         r"model\.lora\.targets: '\*bias' matches only 1-D parameters \('fc0\.bias', \.\.\.\); LoRA adapts 2-D "
         r"weights read by MatMul/Gemm", kind="ConfigError"),
    Case("lora_rank_above_a_weight", ("model.lora.rank=4", "model.lora.targets=[head]"),
         r"model\.lora\.rank=4 is above the smaller dimension of 'head\.weight' \(8 x 3\): choose a rank of at "
         r"most 3", kind="ConfigError"),
    # ---- graph file
    Case("graph_unknown_op", ("model=graph", "model.path={graph_unknown_op}"),
         r"graph_unknown_op\.json': node '.*': unknown op 'conv9d'", kind="GraphError"),
    Case("graph_malformed_json", ("model=graph", "model.path={graph_malformed}"),
         r"graph file '.*graph_malformed\.json' is not valid JSON", kind="GraphError"),
    Case("graph_shape_mismatch", ("model=graph", "model.path={graph_shape}"),
         r"graph_shape\.json': node '.*' \(op 'linear'\): ", kind="GraphError"),
    Case("graph_cycle", ("model=graph", "model.path={graph_cycle}"), r"part of a cycle: ", kind="GraphError"),
    # ---- checkpoint
    Case("checkpoint_other_model", ("model.hidden=[12]",),
         r"checkpoint .*ckpt-\d+\.h5 was written for a different model graph",
         kind="CheckpointError", seed_run=True),
    Case("resume_with_another_frozen_set", ("model.freeze=[fc0.*]",),
         r"checkpoint .*ckpt-\d+\.h5 was trained with 0 frozen parameter\(s\), this run freezes 2 \(model\.freeze / "
         r"model\.train_only\): frozen only in the checkpoint: none; frozen only in this run: fc0\.weight, fc0\.bias\. "
         r"Resume with the setting it was trained with, or start a fine-tune from its weights in a new run "
         r"directory with model\.init_from=", kind="CheckpointError", seed_run=True),
    Case("resume_with_other_lora_adapters", ("model.lora.rank=2", "model.lora.targets=[fc0]"),
         r"checkpoint .*ckpt-\d+\.h5 was trained with other LoRA adapters \(model\.lora\.\*\): the checkpoint's "
         r"none; this run's rank 2, alpha 8 on fc0\.weight\. Resume with the model\.lora keys it was trained with",
         kind="CheckpointError", seed_run=True),
    Case("checkpoint_truncated", ("resume={ckpt}",),
         r"truncate\.h5 is unreadable \(partial write or corrupt file\)",
         kind="CheckpointError", seed_run=True, corrupt="truncate"),
    Case("checkpoint_corrupt", ("resume={ckpt}",), r"flip\.h5 failed its checksum .*the file is corrupt",
         kind="CheckpointError", seed_run=True, corrupt="flip"),
    # ---- disk: a checkpoint is ~9 KiB, everything written before the first one is smaller
    Case("disk_full_checkpoint", ("train.epochs=2", "checkpoint.every_epochs=1"),
         r"could not write checkpoint .*ckpt-00000024\.h5: .*File too large \(disk full or over "
         r"quota\?\); the previous checkpoint ckpt-00000012\.h5",
         kind="CheckpointError", seed_run=True, file_limit_kb=8,
         extra_files_ok=("metrics.jsonl", "config.yaml", "graph.json", "steps.jsonl",
                         "tensorboard/events.out.tfevents.*")),
]


def _expand(text: str, inputs: dict, extra: dict) -> str:
    def sub(m):
        key = m.group(1)
        return str(extra[key] if key in extra else inputs[key])
    return re.sub(r"\{(\w+)\}", sub, text)


# A file-size limit set after MPI is up (MPI's own shared-memory files must not hit it): any
# later write past it fails with EFBIG, which is what a full disk looks like to the writer.
_LIMITED = """
import resource, runpy, sys
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
kb = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (kb * 1024, resource.RLIM_INFINITY))
sys.argv[0] = "hpc_rlx"
runpy.run_module("hpc_rlx", run_name="__main__", alter_sys=True)
"""


def _run(case: Case, run: Path, overrides: list[str]):
    if case.file_limit_kb is None:
        return train_job(2, run, overrides, timeout=TIMEOUT)
    import subprocess
    cmd = launch_cmd(2, ["-c", _LIMITED, str(case.file_limit_kb), f"hydra.run.dir={run}", "report.plots=false",
                         *overrides])
    try:
        return subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case.id}: no exit within {TIMEOUT}s")


def _damage(src: Path, dst: Path, how: str) -> None:
    raw = bytearray(src.read_bytes())
    if how == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        # flip bytes inside the stored parameters themselves (free space in the file would
        # go unnoticed, and rightly so)
        with h5py.File(src, "r") as f:
            names = []
            f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.size > 16 else None)
            offset = f[names[0]].id.get_offset()
        assert offset is not None
        raw[offset: offset + 16] = bytes(b ^ 0xFF for b in raw[offset: offset + 16])
    dst.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_error(case: Case, inputs, request, tmp_path):
    if case.skip_with_gpu:
        from hpc_rlx.base.backend import gpu_count
        if gpu_count() > 0:
            pytest.skip("a GPU is usable here")
    run = tmp_path / "run"
    extra = {}
    if case.seed_run:
        source = request.getfixturevalue("source_run")
        shutil.copytree(source / "checkpoints", run / "checkpoints")
        newest = sorted((run / "checkpoints").glob("ckpt-*.h5"))[-1]
        if case.corrupt:
            damaged = tmp_path / f"{case.corrupt}.h5"
            _damage(newest, damaged, case.corrupt)
            extra["ckpt"] = damaged
    before = _hash_tree(run)
    overrides = ["data=file", f"data.path={inputs[case.data]}"] if case.data else ["data=file"]
    mine = [_expand(o, inputs, extra) for o in case.overrides]
    other_model = any(o.startswith("model=") for o in mine)
    overrides += [o for o in SMALL if not (other_model and o.startswith("model."))] + mine

    t0 = time.monotonic()
    proc = _run(case, run, overrides)
    elapsed = time.monotonic() - t0

    assert proc.returncode == 2, f"{case.id}: expected the agreed-error exit 2\n" + explain(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("hpc_rlx: error")]
    assert len(errors) == 1, f"{case.id}: expected one error line\n" + explain(proc)
    assert errors[0].startswith(f"hpc_rlx: error ({case.kind}, reported by rank "), explain(proc)
    assert re.search(case.expect, proc.stderr), f"{case.id}: /{case.expect}/ not in the message\n" + explain(proc)
    assert "Traceback" not in proc.stderr and "aborting all" not in proc.stderr, explain(proc)
    assert elapsed < TIMEOUT

    # nothing written, nothing damaged (the run's log and lock aside)
    after = _hash_tree(run)
    for name, digest in before.items():
        assert after.get(name) == digest, f"{case.id}: {name} was changed or removed"
    allowed = ("hpc_rlx.log", ".hpc_rlx.lock", *case.extra_files_ok)        # names or glob patterns
    new = sorted(f for f in set(after) - set(before) if not any(fnmatch.fnmatch(f, a) for a in allowed))
    assert not new, f"{case.id}: files written: {new}"
    assert not list(run.glob("**/*.tmp")), f"{case.id}: temporary files left behind"
    log = run / "hpc_rlx.log"
    if log.exists() and log.stat().st_size:      # the run's own log: what it printed, the error last
        assert errors[0] in log.read_text().splitlines()[-1], log.read_text()


def test_every_issue_case_is_in_the_table():
    """The issue's list, so a case cannot silently drop out of the table."""
    ids = {c.id for c in CASES}
    for needed in ("missing_file", "missing_dataset", "empty_dataset", "input_shape_vs_model",
                   "float_labels", "labels_out_of_range", "nan_inputs_checked", "not_hdf5",
                   "fewer_samples_than_ranks_x_lanes", "batch_zero", "batch_negative",
                   "batch_larger_than_data", "seed_beyond_64_bits", "unknown_key", "unknown_group_option", "negative_lr",
                   "unknown_device_option", "cuda_without_gpu", "unwritable_run_dir",
                   "graph_unknown_op", "graph_malformed_json", "graph_shape_mismatch", "graph_cycle",
                   "checkpoint_other_model", "checkpoint_truncated", "checkpoint_corrupt",
                   "disk_full_checkpoint", "freeze_and_train_only", "freeze_glob_matching_nothing",
                   "freeze_leaving_nothing_to_train", "resume_with_another_frozen_set",
                   "lora_targets_not_2d_weights", "lora_rank_above_a_weight", "resume_with_other_lora_adapters"):
        assert needed in ids, needed
