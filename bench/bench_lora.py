"""LoRA adapters against full fine-tuning, side by side in one run: bytes on the wire per step,
optimizer bytes per rank and step time, in hpc_rlx on 2 ranks and in PyTorch (+ PEFT) on one
thread.

    .venv/bin/python bench/bench_lora.py --profile   # 3 rounds and the profiles (bench/README.md's run)
    .venv/bin/python bench/bench_lora.py --rounds 1 --steps 2 --sides full,lora --out /tmp/lora.jsonl
                                                     # a quick look; --out: the raw file it rewrites

The model: transformers' BertForSequenceClassification built from BertConfig (hidden 512, 4
layers, 8 heads, intermediate 2048, a 30,522-token vocabulary, 128 positions, 2 labels, dropout
0; 28.6 M parameters, seed 0), wrapped to take `input_ids` and `attention_mask` and return the
logits, exported once to ONNX (dynamo, `optimize=False`). The data: padded rows of 128 token
ids (each row 64 to 128 tokens long, the rest id 0 with mask 0) and a label, in one HDF5 file
(`input_ids`, `attention_mask`, `labels`).

Six sides (`--sides` picks), float32, AdamW (lr 1e-4, weight decay 0.01, constant schedule), each
round running them in turn (the order reversed every other round, so background load hits them
alike):
- `full` and `lora`: hpc_rlx under `mpirun -n 2`, one BLAS thread per rank, `--batch` rows per
  rank (`train.batch_size` = 2 x batch), `--steps` steps an epoch, `--epochs` epochs of which
  the first is warm-up and not timed; the step time is hpc_rlx's own `samples_per_s` (rank 0's
  step wall time: batch gather, forward/backward, Allreduce, optimizer) over the timed epochs.
  `comm.shared_memory=false`: MPI's Allreduce sums the bucket, as between two nodes, so
  `wire_bytes` (metrics.jsonl, summed over the ranks) gives its ring volume; summed in shared
  memory on one node it would be 0 (docs/observe.md). The optimizer bytes per rank are each
  rank's `optimizer_bytes` in summary.json (read, not computed). LoRA: `model.lora.rank=8
  model.lora.alpha=16 model.lora.targets=[*query,*key,*value,*attention.output.dense]` and the
  classifier head in `model.train_only=[*classifier.*]` (the wrapper puts the transformers
  model under `model.`).
- `torch_lora` and `torch_full`: PyTorch on one thread (`torch.set_num_threads(1)`), the same
  model, batch (`--batch` rows: one rank's share), optimizer and steps, with PEFT's LoraConfig
  (r 8, alpha 16, dropout 0, the same four projections, the classifier in `modules_to_save`)
  for `torch_lora`; the mean step time over the steps after the warm-up epoch's. No process
  group: `--torch-copies` (default 2) independent processes run at once, so that on a machine
  of few cores both sides share them alike (hpc_rlx's 2 ranks take 2 cores); the figure is the
  mean of the copies' step times.
- `lora_1rank` and `torch_lora_alone`: the LoRA job on one rank alone (`--batch` rows a step, so
  twice the steps of an epoch on the same file) and one PyTorch + PEFT process alone: each
  side's step with the cores to itself, so that the engine's own speed shows apart from what
  two processes sharing the cores cost.
Ratios: LoRA / full in hpc_rlx (goal <= 0.75), LoRA in hpc_rlx / PyTorch + PEFT (goal <= 1.0:
2 ranks against the 2 copies, 2 ranks against one process alone, and 1 rank against one process
alone), wire bytes full / LoRA (goal >= 50x). Each record goes to `--out` as one JSON line;
`bench/tables.py` makes bench/README.md's table from them.

`--profile` adds, after the rounds, one profiled job per side of `full`, `lora`, `torch_full`
and `torch_lora`, each kept in `--out` as a `lora_profile` record: for hpc_rlx a traced job
(`trace.enabled=true`), rank 0's mean time per timed step in each span (forward/backward,
Allreduce, optimizer, data), and the engine's forward + backward per op type on that run's
graph (`graph/node_timing.py`, `--batch` synthetic rows, one thread, one process); for PyTorch
its profiler's self CPU time per aten op and step (one process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PYTHON, REPO, git_commit, hpc_throughput, machine_note, mpirun, one_thread_env, result_line  # noqa: E402
from tables import append_record, lora_profile_table, lora_table  # noqa: E402

BERT = dict(vocab_size=30522, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048,
            max_position_embeddings=128, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SEQ = 128
RANKS = 2
RANK, ALPHA = 8, 16
TARGETS = ["query", "key", "value", "attention.output.dense"]       # PEFT's suffixes
TARGET_GLOBS = "[" + ",".join("*" + t for t in TARGETS) + "]"       # the same modules as hpc_rlx globs
LR, WEIGHT_DECAY = 1e-4, 0.01
SIDES = ("full", "lora", "torch_full", "torch_lora", "lora_1rank", "torch_lora_alone")
PROFILED = ("full", "lora", "torch_full", "torch_lora")
DEFAULT_OUT = REPO / "bench" / "results" / "lora" / "rounds.jsonl"


def bert_module():
    """The benchmark's BERT (seed 0), taking (input_ids, attention_mask) and returning logits."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    class IdsAndMask(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    torch.manual_seed(0)
    return IdsAndMask(transformers.BertForSequenceClassification(transformers.BertConfig(**BERT)))


def export(path: Path) -> Path:
    """The model as ONNX (its weights in `path`.data beside it), written once."""
    if path.exists():
        return path
    import torch
    net = bert_module().train()
    ids, mask = torch.randint(0, BERT["vocab_size"], (2, SEQ)), torch.ones(2, SEQ, dtype=torch.long)
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_shapes=({0: batch}, {0: batch}), optimize=False,
                          verbose=False)
    return path


def write_data(path: Path, rows: int) -> Path:
    """`rows` padded rows: token ids, their mask and a label, seed 0."""
    import h5py
    import numpy as np
    rng = np.random.default_rng(0)
    lengths = rng.integers(SEQ // 2, SEQ + 1, rows)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, BERT["vocab_size"], (rows, SEQ)) * mask
    with h5py.File(path, "w") as f:
        f["input_ids"], f["attention_mask"] = ids.astype(np.int64), mask
        f["labels"] = rng.integers(0, BERT["num_labels"], rows).astype(np.int64)
    return path


def ranks_of(side: str) -> int:
    """`lora_1rank`: the LoRA job on one rank alone (its engine against one PyTorch process alone)."""
    return 1 if side == "lora_1rank" else RANKS


def hpc_overrides(side: str, run_dir: Path, onnx: Path, data: Path, args, val_rows: int) -> list:
    train_rows = RANKS * args.batch * args.steps        # the file's rows, whatever the job's ranks
    out = ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "model=onnx", f"model.path={onnx}", "data=file",
           f"data.path={data}", "data.x=[input_ids,attention_mask]", "data.y=labels",
           f"data.val_fraction={val_rows / (train_rows + val_rows)}", "optim=adamw", f"optim.lr={LR}",
           f"optim.weight_decay={WEIGHT_DECAY}", "optim.schedule=constant",
           f"train.batch_size={ranks_of(side) * args.batch}",
           f"train.epochs={args.epochs}", "train.threads_per_rank=1", "train.dtype=float32", "checkpoint=off",
           "report.plots=false", "report.tensorboard=false", "comm.shared_memory=false"]
    if side.startswith("lora"):
        out += [f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", f"model.lora.targets={TARGET_GLOBS}",
                "model.train_only=[*classifier.*]"]
    return out + list(args.extra)


def hpc_job(side: str, run_dir: Path, onnx: Path, data: Path, args, val_rows: int, extra=()) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)      # a fresh run, never a resume of a kept one
    mpirun(ranks_of(side), hpc_overrides(side, run_dir, onnx, data, args, val_rows) + list(extra),
           timeout=args.timeout, env=one_thread_env())
    tput = hpc_throughput(run_dir, ranks_of(side) * args.batch)
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epochs = [e for e in epochs if "epoch" in e and "event" not in e][1:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"trainable": trainable_values(run_dir), "step_ms": tput["step_ms"], "comm_frac": tput["comm_frac"],
            "steps": tput["steps"],
            "wire_bytes_per_step": sum(e["wire_bytes"] for e in epochs) / sum(e["steps"] for e in epochs),
            "optimizer_bytes": [r["optimizer_bytes"] for r in summary["ranks"]],
            "param_bytes": [r["param_bytes"] for r in summary["ranks"]]}


def trainable_values(run_dir: Path) -> int:
    """The values that train, from the run's start-up lines: the frozen-parameter line where some
    are frozen, else the parameter count."""
    log = (run_dir / "hpc_rlx.log").read_text()
    found = re.search(r"([\d,]+) values train", log) or re.search(r"lanes on rank 0: .*?, (\d+) parameters", log)
    if not found:
        raise SystemExit(f"no parameter count in {run_dir / 'hpc_rlx.log'}")
    return int(found.group(1).replace(",", ""))


def one_step(model, opt, ids, mask, y):
    import torch
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(ids, mask), y)
    loss.backward()
    opt.step()
    return loss


def torch_child(side: str, data: Path, batch: int, steps: int, epochs: int, profile: bool = False) -> None:
    """One process, one thread: `epochs` x `steps` AdamW steps of `batch` rows (the data's rows in
    order, as one rank's share); prints a RESULT line with the mean step time after the first
    epoch and the trainable parameter count."""
    import h5py
    import torch
    torch.set_num_threads(1)
    model = bert_module().train()
    if side.startswith("torch_lora"):
        import peft
        model.model = peft.get_peft_model(model.model, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, modules_to_save=["classifier"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY)
    with h5py.File(data, "r") as f:
        ids, mask, y = (torch.from_numpy(f[k][:batch * steps]) for k in ("input_ids", "attention_mask", "labels"))
    times = []
    for epoch in range(epochs):
        for s in range(steps):
            rows = slice(s * batch, (s + 1) * batch)
            t0 = time.perf_counter()
            loss = one_step(model, opt, ids[rows], mask[rows], y[rows])
            if epoch > 0:
                times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    result = {"step_ms": 1e3 * statistics.mean(times), "steps": len(times),
              "trainable": sum(p.numel() for p in trainable), "optimizer_bytes": state, "loss": loss.item()}
    if profile:
        result["ops_ms"] = torch_ops(model, opt, ids[:batch], mask[:batch], y[:batch], steps)
    print("RESULT " + json.dumps(result), flush=True)


def torch_job(side: str, data: Path, args, profile: bool = False) -> dict:
    """`args.torch_copies` PyTorch processes at once (each its own one thread and batch, as the
    hpc_rlx ranks run side by side): the mean of their step times, each copy's kept. Profiled,
    and `torch_lora_alone`: one process."""
    alone = profile or side == "torch_lora_alone"
    cmd = [PYTHON, str(Path(__file__).resolve()), "--torch-child", side, "--data", str(data), "--batch",
           str(args.batch), "--steps", str(args.steps), "--epochs", str(args.epochs)]
    cmd += ["--profile"] if profile else []
    procs = [subprocess.Popen(cmd, cwd=REPO, env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(1 if alone else args.torch_copies)]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(f"failed (rc={proc.returncode}): {' '.join(cmd)}\n{out[-2000:]}\n{err[-3000:]}")
            outs.append(result_line(out))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"timed out after {args.timeout}s: {' '.join(cmd)}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return dict(outs[0], step_ms=statistics.mean(o["step_ms"] for o in outs),
                copies_step_ms=[o["step_ms"] for o in outs])


def span_profile(run_dir: Path, steps_per_epoch: int) -> dict:
    """Rank 0's spans inside the steps after the first epoch (a span counts in the step that
    contains it): {name: mean ms per step}, `step` the whole step."""
    events = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("pid") == 0 and e["name"] != "chunk"]
    steps = [e for e in events if e["name"] == "step" and e["args"]["step"] > steps_per_epoch]
    per: dict = {}
    for s in steps:
        inside: dict = {"step": s["dur"] * 1e-3}
        for e in events:
            if e["name"] != "step" and s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]:
                inside[e["name"]] = inside.get(e["name"], 0.0) + e["dur"] * 1e-3
        for name, ms in inside.items():
            per.setdefault(name, []).append(ms)
    return {name: round(sum(ms) / len(steps), 2) for name, ms in per.items()}


def engine_ops(run_dir: Path, rows: int) -> dict:
    """The engine's forward + backward per op type on the run's own graph (its frozen parameters
    and adapters as trained), `rows` synthetic rows, one thread: {op: ms}, {op: nodes}."""
    from threadpoolctl import threadpool_limits

    from hpc_rlx.graph.ir import Graph
    from hpc_rlx.graph.node_timing import node_times
    graph = Graph.from_dict(json.loads((run_dir / "graph.json").read_text()))
    with threadpool_limits(limits=1):
        times = node_times(graph, rows=rows, reps=3)
    ops = {n.name: n.op for n in graph.nodes}
    out: dict = {}
    for name, t in times.items():
        out[ops.get(name, name)] = out.get(ops.get(name, name), 0.0) + 1e3 * t
    return {k: round(v, 2) for k, v in out.items()}, dict(Counter(ops[n] for n in times if n in ops))


def torch_ops(model, opt, ids, mask, y, steps: int) -> dict:
    """PyTorch's profiler over `steps` more steps: {aten op: self CPU ms per step}."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            one_step(model, opt, ids, mask, y)
    return {e.key: round(e.self_cpu_time_total / 1e3 / steps, 2) for e in prof.key_averages()
            if e.self_cpu_time_total > 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="rows per rank (the PyTorch side's whole batch)")
    ap.add_argument("--steps", type=int, default=4, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per job, the first one warm-up (not timed)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {','.join(SIDES)}")
    ap.add_argument("--profile", action="store_true", help="after the rounds, one profiled job per side")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON lines, one record per job (the file is "
                    "rewritten: it holds one run)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the export, data and runs here")
    ap.add_argument("--torch-copies", type=int, default=RANKS,
                    help="PyTorch processes run at once, each on one thread (default: as many as hpc_rlx's ranks)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--extra", nargs="*", default=[], help="more hpc_rlx overrides for both hpc_rlx sides")
    ap.add_argument("--torch-child", choices=("torch_full", "torch_lora", "torch_lora_alone"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torch_child:
        torch_child(args.torch_child, args.data, args.batch, args.steps, args.epochs, args.profile)
        return 0
    sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(sides) - set(SIDES))
    if unknown or not sides:
        ap.error(f"--sides: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(SIDES)}")
    if args.epochs < 2 or min(args.steps, args.batch, args.rounds, args.torch_copies) < 1:
        ap.error("--epochs must be at least 2 (the first is warm-up); --steps, --batch, --rounds and --torch-copies "
                 "at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        return measure(args, sides, work)


def measure(args, sides: list, work: Path) -> int:
    import torch
    print(machine_note())
    t0 = time.perf_counter()
    onnx = export(work / "bert.onnx")
    val_rows = RANKS * args.batch
    data = write_data(work / f"rows_{args.batch}_{args.steps}.h5", RANKS * args.batch * args.steps + val_rows)
    print(f"export and data: {time.perf_counter() - t0:.1f} s; {onnx}")
    setting = {"model": "bert", **{k: BERT[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "intermediate_size", "vocab_size")},
               "seq": SEQ, "ranks": RANKS, "batch_per_rank": args.batch, "steps": args.steps,
               "timed_epochs": args.epochs - 1, "rank": RANK, "alpha": ALPHA, "targets": TARGET_GLOBS,
               "optim": "adamw", "dtype": "float32", "torch_copies": args.torch_copies, "extra": list(args.extra)}
    stamp = {"bench": "lora", "setting": setting, "commit": git_commit(), "torch": torch.__version__}
    args.out.unlink(missing_ok=True)
    records = []
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            rec = dict(stamp, round=r, side=side, load_before=round(os.getloadavg()[0], 2),
                       date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))
            if side.startswith("torch"):
                rec.update(torch_job(side, data, args))
            else:
                rec.update(hpc_job(side, work / f"run_{side}_{r}", onnx, data, args, val_rows))
            records.append(rec)
            append_record(args.out, rec)
            print(f"  round {r + 1} {side:10s} step {rec['step_ms']:8.1f} ms"
                  + (f", wire {rec['wire_bytes_per_step'] / 2**20:.2f} MiB/step, optimizer "
                     f"{rec['optimizer_bytes'][0] / 2**20:.2f} MiB/rank" if "wire_bytes_per_step" in rec else
                     f", optimizer {rec['optimizer_bytes'] / 2**20:.2f} MiB, {rec['trainable']:,} trainable"),
                  flush=True)
    profiles = []
    if args.profile:
        for side in [s for s in sides if s in PROFILED]:
            rec = dict(stamp, bench="lora_profile", side=side, load_before=round(os.getloadavg()[0], 2),
                       date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))
            if side.startswith("torch"):
                rec.update(torch_job(side, data, args, profile=True))
            else:
                run_dir = work / f"profile_{side}"
                rec.update(hpc_job(side, run_dir, onnx, data, args, val_rows, extra=["trace.enabled=true"]),
                           spans_ms=span_profile(run_dir, args.steps))
                rec["ops_ms"], rec["op_nodes"] = engine_ops(run_dir, args.batch)
                print(f"  profile {side}: " + ", ".join(f"{k} {v} ms" for k, v in sorted(rec["spans_ms"].items())))
            append_record(args.out, rec)
            profiles.append(rec)
    print()
    print(lora_table(records))
    if profiles:
        print(lora_profile_table(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
