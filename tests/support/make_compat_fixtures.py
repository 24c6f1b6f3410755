"""Write the fixtures of tests/mpi/checkpoint/test_compat_before_reshaping.py: for each case, a
checkpoint taken in the middle of a small 2-rank float64 run, and the final parameters and last
epoch record's losses of that run continued to its end, all by the code of this checkout.

    .venv/bin/python -m tests.support.make_compat_fixtures

The fixtures stand for the code that wrote them: regenerate them only on purpose (a deliberate
change of the training's arithmetic), never to make the test pass. Each continuation runs twice
from copies of the same stopped run and must end bitwise alike, or nothing is written.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.checkpoint import checkpoint_name, checkpoints_dir, read_checkpoint

from tests.support.jobs import REPO, explain, read_metrics, train_job, write_small_classification

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ckpt_before_reshaping"
RANKS = 2
DATA_ROWS, DATA_SEED = 480, 0
# 384 training rows (val_fraction 0.2) in global batches of 24: 16 steps an epoch under sync
COMMON = ["data=file", "train.epochs=3", "train.batch_size=24", "model.hidden=[8]", "train.seed=3",
          "train.dtype=float64", "comm.deterministic=true", "report.tensorboard=false",
          "checkpoint.every_minutes=null", "checkpoint.every_epochs=1", "checkpoint.keep_last=10"]
# the last epoch record's values the test compares (exactly)
RECORD_KEYS = ("epoch", "step", "train_loss", "val_loss", "train_accuracy", "val_accuracy")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    stop: int          # the global step of the checkpoint the test resumes from
    in_flight: bool = False     # the checkpoint must hold a streaming fragment in flight

    def args(self, data: Path) -> list[str]:
        return [*COMMON, f"data.path={data}", *self.overrides]


CASES = (
    Case("sync", ("policy=sync",), stop=21),
    # windows of 4 local steps on both ranks (lockstep, anchor pinned): the same windows in
    # every run; DiLoCo's outer momentum adds the policy's own state to the checkpoint
    Case("cadence", ("policy=cadence", "policy.anchor=4", "policy.max_anchor=4", "policy.max_batch_diff=0",
                     "policy.overhead_target=1e-6", "policy.outer=diloco", "policy.outer_warmup=2"), stop=6),
    # streaming fragments (async, untuned): a fragment in flight at the stop, int8 wire residuals,
    # each rank's own AdamW moments
    Case("async_fragments", ("policy=async", "policy.tune=false", "policy.anchor=4", "policy.fragments=2",
                             "policy.fragment_delay=1", "policy.outer=diloco", "policy.outer_warmup=2",
                             "policy.outer_wire_dtype=int8", "optim=adamw"), stop=11, in_flight=True),
    # ZeRO-1: each rank's slice of the AdamW moments
    Case("sharded", ("policy=sync", "comm.shard=optimizer", "optim=adamw"), stop=21),
)


def write_data(folder: Path) -> Path:
    return write_small_classification(folder / "small.h5", rows=DATA_ROWS, seed=DATA_SEED)


def model_params(run: Path) -> dict[str, np.ndarray]:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f}


def last_record(run: Path) -> dict:
    record = read_metrics(run)[-1]
    return {k: record[k] for k in RECORD_KEYS}


def _train(run: Path, args: list[str]) -> None:
    proc = train_job(RANKS, run, args, timeout=180)
    if proc.returncode != 0:
        sys.exit(f"{run.name}: the job failed\n{explain(proc)}")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def make_case(case: Case, work: Path, data: Path) -> dict:
    """Stop a run at `case.stop`, continue two copies of it to the end; what the fixture holds."""
    stopped = work / case.name / "stopped"
    _train(stopped, case.args(data) + [f"train.max_steps={case.stop}"])
    ckpt = checkpoints_dir(stopped) / checkpoint_name(case.stop)
    if not ckpt.exists():
        sys.exit(f"{case.name}: no checkpoint at step {case.stop}: {sorted(checkpoints_dir(stopped).iterdir())}")
    meta = read_checkpoint(ckpt, arrays=False).meta
    if meta["step_in_epoch"] == 0:
        sys.exit(f"{case.name}: the checkpoint at step {case.stop} falls on an epoch's end: stop inside one")
    if case.in_flight and meta["policy"]["state"]["streaming"]["in_flight"] is None:
        sys.exit(f"{case.name}: no fragment in flight at step {case.stop}")
    ends = []
    for copy in ("a", "b"):
        run = work / case.name / copy
        shutil.copytree(stopped, run)
        _train(run, case.args(data))
        ends.append((model_params(run), last_record(run)))
    if not (_same(ends[0][0], ends[1][0]) and ends[0][1] == ends[1][1]):
        sys.exit(f"{case.name}: two continuations of one checkpoint differ: not a fixture")
    out = FIXTURES / case.name
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ckpt, out / ckpt.name)
    shutil.copyfile(work / case.name / "a" / "model.h5", out / "model.h5")
    (out / "last_record.json").write_text(json.dumps(ends[0][1], indent=1) + "\n")
    return meta


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _commit() -> str:
    """The checkout's commit, and the last one that changed hpc_rlx/ (the code the fixtures stand for)."""
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "hpc_rlx")
    return (f"{_git('rev-parse', 'HEAD')} (hpc_rlx/ last changed in {_git('log', '-1', '--format=%H', '--', 'hpc_rlx')}"
            + (", with uncommitted changes there)" if dirty else ")"))


def main() -> None:
    shutil.rmtree(FIXTURES, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="compat-fixtures-") as tmp:
        work = Path(tmp)
        data = write_data(work)
        metas = {case.name: make_case(case, work, data) for case in CASES}
    lines = ["Checkpoints written by hpc_rlx before its third reshaping (issue 47), each resumed by",
             "tests/mpi/checkpoint/test_compat_before_reshaping.py, which must end with the same bytes.",
             "",
             f"Written by commit {_commit()} with",
             "`python -m tests.support.make_compat_fixtures` (the cases and their overrides are there).",
             f"Data: write_small_classification(rows={DATA_ROWS}, seed={DATA_SEED}); {RANKS} ranks.",
             "",
             "Per case: the checkpoint of a run stopped at `train.max_steps`, that run's final",
             "`model.h5` when continued to its end, and its last epoch record (`last_record.json`).",
             ""]
    for case in CASES:
        meta = metas[case.name]
        lines.append(f"- {case.name}: ckpt at global step {meta['step']} (epoch {meta['epoch']}, "
                     f"step in epoch {meta['step_in_epoch']}): {' '.join(case.overrides)}")
    (FIXTURES / "README.md").write_text("\n".join(lines) + "\n")
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    print(f"wrote {FIXTURES} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
