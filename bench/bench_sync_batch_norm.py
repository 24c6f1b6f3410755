"""`model.sync_batch_norm` on vs off: the step time of a batch-norm CNN under mpirun.

    .venv/bin/python bench/bench_sync_batch_norm.py                 # 2 ranks, 3 rounds, ~2 minutes
    .venv/bin/python bench/bench_sync_batch_norm.py --ranks 2 --rounds 5 --per-rank 16

Model (a graph JSON, `model=graph`): three blocks of 3x3 conv + batch norm + ReLU (16, 32, 32
channels, a 2x2 max pool after the first two) on 3x16x16 inputs, then a linear head; float32,
SGD, one BLAS thread per rank. With the key, each of the three batch-norm layers adds one small
Allreduce to the forward and one to the backward of every step (the first layer's input is a
convolution's output, so all three have both). Variants are alternated within every round so
background load hits them alike. Figures: hpc_rlx's own step time over the epochs after the
first (`samples_per_s`), and the ratio on/off per round, of the medians over rounds and of
the best rounds. Each job's raw figures go to a JSON lines file (`--out`, default
bench/results/sync_batch_norm.jsonl), one line per job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, fmt_table, hpc_throughput, machine_note, mpirun, one_thread_env  # noqa: E402

SHAPE, CLASSES = (3, 16, 16), 10


def write_model(path: Path) -> Path:
    from hpc_rlx.graph import GraphBuilder
    b = GraphBuilder("bn_cnn")
    h, y = b.input("x", [None, *SHAPE]), b.input("y", [None], "int64")
    c_in = SHAPE[0]
    for i, (c, pool) in enumerate([(16, True), (32, True), (32, False)]):
        w = b.param(f"conv{i}.weight", [c, c_in, 3, 3], {"scheme": "he_normal", "fan_in": c_in * 9})
        h = b.op("conv2d", h, w, padding=1)
        bn = [b.param(f"bn{i}.weight", [c], {"scheme": "ones"}), b.param(f"bn{i}.bias", [c], {"scheme": "zeros"}),
              b.param(f"bn{i}.running_mean", [c], {"scheme": "zeros"}, trainable=False),
              b.param(f"bn{i}.running_var", [c], {"scheme": "ones"}, trainable=False)]
        h = b.op("relu", b.op("batch_norm", h, *bn))
        if pool:
            h = b.op("max_pool2d", h, kernel=2)
        c_in = c
    fc = b.param("fc.weight", [c_in * 4 * 4, CLASSES], {"scheme": "he_normal", "fan_in": c_in * 16})
    logits = b.op("linear", b.op("flatten", h), fc)
    b.output("loss", b.op("softmax_cross_entropy", logits, y))
    b.output("correct", b.op("correct_count", logits, y))
    path.write_text(b.build().to_json())
    return path


def write_data(path: Path, samples: int) -> Path:
    import h5py
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((samples, *SHAPE)).astype(np.float32) + 0.5
        f["y"] = rng.integers(0, CLASSES, samples)
    return path


def run_variant(n: int, model: Path, data: Path, batch: int, epochs: int, work: Path, extra: list[str]) -> dict:
    run_dir = work / f"run_{time.monotonic_ns()}"
    args = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "model=graph", f"model.path={model}",
            "data=file", f"data.path={data}", "data.val_fraction=0", f"train.batch_size={batch}",
            f"train.epochs={epochs}", "train.threads_per_rank=1", "device=cpu", "optim=sgd", "optim.lr=0.01",
            "optim.schedule=constant", "checkpoint=off", "report.plots=false", "train.log_every_s=1000"] + extra
    mpirun(n, args, timeout=900, env=one_thread_env())
    return hpc_throughput(run_dir, batch, skip_epochs=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-rank", type=int, default=16, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=40, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sync_batch_norm.jsonl")
    a = ap.parse_args()
    n, batch = a.ranks, a.per_rank * a.ranks
    variants = [("off", []), ("on", ["model.sync_batch_norm=true"])]
    rows: dict[str, list[dict]] = {name: [] for name, _ in variants}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_sync_bn_") as tmp:
        work = Path(tmp)
        model = write_model(work / "bn_cnn.json")
        data = write_data(work / "data.h5", batch * a.steps)
        for r in range(a.rounds):
            for name, extra in variants:
                out = run_variant(n, model, data, batch, a.epochs, work, extra)
                rec = dict(bench="sync_batch_norm", variant=name, round=r, ranks=n, per_rank=a.per_rank,
                           steps_per_epoch=a.steps, epochs_run=a.epochs, time=time.strftime("%Y-%m-%dT%H:%M:%S"), **out)
                rows[name].append(rec)
                with a.out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
    print(machine_note())
    table = []
    for r in range(a.rounds):
        off, on = rows["off"][r]["step_ms"], rows["on"][r]["step_ms"]
        table.append([r, off, on, on / off])
    med_off = statistics.median(x["step_ms"] for x in rows["off"])
    med_on = statistics.median(x["step_ms"] for x in rows["on"])
    table.append(["median", med_off, med_on, med_on / med_off])
    best_off, best_on = min(x["step_ms"] for x in rows["off"]), min(x["step_ms"] for x in rows["on"])
    table.append(["best", best_off, best_on, best_on / best_off])
    print(f"{n} ranks, {a.per_rank} samples per rank per step, 3 batch-norm layers")
    print(fmt_table(["round", "off step ms", "on step ms", "on/off"], table))


if __name__ == "__main__":
    main()
