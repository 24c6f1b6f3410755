"""The raw results of bench_streaming.py, bench_policies.py and bench_lora.py (JSON lines, one
record per job, kept under bench/results/) and the Markdown tables made from them: means over
the seeds (bench_lora.py: the rounds), with the spread (lowest-highest) beside each mean.

    .venv/bin/python bench/tables.py bench/results/streaming_n2.jsonl   # print the tables
    .venv/bin/python bench/tables.py --readme bench/README.md           # rewrite its tables
    .venv/bin/python bench/tables.py --readme bench/README.md --check   # exit 1 if out of date

In a README a generated table sits between two markers, the first naming the file:

    <!-- tables.py bench/results/streaming_n2.jsonl -->
    | run | ... |
    <!-- end tables.py -->

The benchmarks print the same tables at their end, from the records they have just written.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!-- tables\.py (\S+) -->\n(.*?)<!-- end tables\.py -->\n", re.S)


def append_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def spread(values: list[float], fmt: str) -> str:
    """'mean (lowest-highest)', or the one value."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def _groups(records: list[dict]) -> dict[str, list[dict]]:
    """Records by setting (everything a job shares with its row's other seeds), in file order."""
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(json.dumps(r["setting"], sort_keys=True), []).append(r)
    return out


def _by(records: list[dict], key: str) -> dict[str, dict[int, dict]]:
    """{row: {seed: record}}, rows in file order; a seed run twice keeps its last record."""
    out: dict[str, dict[int, dict]] = {}
    for r in records:
        out.setdefault(r[key], {})[r["seed"]] = r
    return out


def _when(records: list[dict]) -> str:
    """', DATE, load average LO-HI at the jobs' starts' from the records that carry them."""
    loads = [r["load_before"] for r in records if r.get("load_before") is not None]
    dates = sorted(r["date"] for r in records if r.get("date"))
    out = f", {dates[0][:16].replace('T', ' ')}-{dates[-1][11:16]} UTC" if dates else ""
    return out + (f", load average {min(loads):.1f}-{max(loads):.1f} at the jobs' starts" if loads else "")


def _md(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ---- bench_streaming.py -----------------------------------------------------------------------

def time_to(curve: list, target: float) -> float | None:
    """Training seconds until the validation loss first reached `target` (linear within the
    epoch that crossed it: the loss is only known at epoch ends)."""
    spent, before = 0.0, None
    for seconds, loss in curve:
        if loss <= target:
            if before is None or before <= loss:
                return spent + seconds
            return spent + seconds * (before - target) / (before - loss)
        spent += seconds
        before = loss
    return None


def streaming_table(records: list[dict]) -> str:
    """One table per setting; every ratio is taken against sync of the same seed, then averaged."""
    out = []
    for recs in _groups(records).values():
        s = recs[0]["setting"]
        rows = _by(recs, "row")
        ref = rows.get("sync", {})
        seeds = sorted(set.intersection(*(set(r) for r in rows.values())) & set(ref))
        if not seeds:
            continue
        where = f"link {s['link']}" if s.get("link") else "this host"
        head = (f"{s['ranks']} ranks, {where}, K={s['k']}, {s['epochs']} epochs, seeds {', '.join(map(str, seeds))}"
                + (f", {' '.join(s['extra'])}" if s.get("extra") else "") + _when(recs) + ":\n\n")
        table = []
        for name, by_seed in rows.items():
            cs = [by_seed[seed] for seed in seeds]
            rs = [ref[seed] for seed in seeds]
            ratio = [c["val_loss"] / r["val_loss"] for c, r in zip(cs, rs)]
            reach = [time_to(c["curve"], r["val_loss"]) for c, r in zip(cs, rs)]
            total = [sum(t for t, _ in r["curve"]) for r in rs]
            if all(t is not None for t in reach):
                to_s = spread(reach, ".1f")
                to_r = spread([t / tot for t, tot in zip(reach, total)], ".2f")
            else:
                to_s = to_r = f"- ({sum(t is not None for t in reach)} of {len(seeds)})"
            table.append([cs[0]["label"], f"{statistics.mean(c['syncs'] for c in cs):.3g}",
                          f"{statistics.mean(c['wire'] for c in cs) / 2**20:.2f}",
                          f"{statistics.mean(r['wire'] / max(c['wire'], 1) for c, r in zip(cs, rs)):.0f}x",
                          spread([c["val_loss"] for c in cs], ".4f"), spread(ratio, ".4f"), to_s, to_r])
        out.append(head + _md(["run", "syncs/ep", "wire MB", "fewer", "val_loss", "vs sync", "to sync's loss (s)",
                               "vs sync's time"], table))
    return "\n".join(out)


# ---- bench_policies.py ------------------------------------------------------------------------

def policies_table(records: list[dict]) -> str:
    """One table per setting and slowdown; speed is sync's epoch time over the row's, per seed."""
    out = []
    for recs in _groups(records).values():
        s = recs[0]["setting"]
        slows: dict[str, list[dict]] = {}
        for r in recs:
            slows.setdefault(r["slowdown"], []).append(r)
        for slowdown, srecs in slows.items():
            rows = _by(srecs, "policy")
            ref = rows.get("sync", {})
            seeds = sorted(set.intersection(*(set(r) for r in rows.values())))
            data = f"blobs {s['blobs']}" if s.get("blobs") is not None else "digits"
            head = (f"{s['ranks']} ranks, slowdown {slowdown}, {data}, {s['epochs']} epochs, seeds "
                    f"{', '.join(map(str, seeds))}" + (f", {' '.join(s['extra'])}" if s.get("extra") else "") + _when(srecs)
                    + ":\n\n")
            table = []
            for policy, by_seed in rows.items():
                cs = [by_seed[seed] for seed in seeds]
                speed = (spread([ref[seed]["epoch_s"] / c["epoch_s"] for seed, c in zip(seeds, cs)], ".2f")
                         .replace(" (", "x (", 1) if set(seeds) <= set(ref) else "-")
                per_sync = [statistics.mean(c["per_sync"][i] for c in cs) for i in range(len(cs[0]["per_sync"]))]
                table.append([policy, f"{statistics.mean(c['epoch_s'] for c in cs):.4f}", speed,
                              spread([c["val_acc"] for c in cs], ".4f"), spread([c["val_loss"] for c in cs], ".4f"),
                              f"{statistics.mean(c['syncs'] for c in cs):.3g}",
                              ", ".join(f"{v:.3g}" for v in per_sync)])
            out.append(head + _md(["policy", "epoch_s", "speed", "val_accuracy", "val_loss", "syncs/ep",
                                   "local steps per sync"], table))
    return "\n".join(out)


# ---- bench_lora.py ----------------------------------------------------------------------------

LORA_SIDES = {"full": "hpc_rlx, full fine-tuning", "lora": "hpc_rlx, LoRA",
              "torch_full": "PyTorch, full fine-tuning", "torch_lora": "PyTorch + PEFT, LoRA",
              "lora_1rank": "hpc_rlx, LoRA, 1 rank alone", "torch_lora_alone": "PyTorch + PEFT, LoRA, 1 process alone"}


def _per_round(rows: dict, num: str, den: str) -> list[float]:
    """`num`'s step time over `den`'s, in each round that ran both."""
    return [rows[num][r]["step_ms"] / rows[den][r]["step_ms"] for r in sorted(rows.get(num, {}))
            if r in rows.get(den, {})]


def _opt_bytes(rec: dict) -> int:
    """A record's optimizer bytes per rank: the largest rank's (hpc_rlx), or the process's (PyTorch)."""
    b = rec["optimizer_bytes"]
    return max(b) if isinstance(b, list) else b


def lora_table(records: list[dict]) -> str:
    """Per setting: each side's trainable values, step time (mean over the rounds, lowest-highest),
    bytes on the wire per step and optimizer bytes per rank; then the ratios against the goals,
    each step-time ratio taken within a round."""
    out = []
    for recs in _groups(records).values():
        s = recs[0]["setting"]
        rows: dict[str, dict[int, dict]] = {}
        for r in recs:
            rows.setdefault(r["side"], {})[r["round"]] = r
        rounds = sorted({r["round"] for r in recs})
        head = (f"BERT (hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, {s['num_attention_heads']} heads, "
                f"intermediate {s['intermediate_size']}, vocabulary {s['vocab_size']:,}), sequence {s['seq']}, "
                f"{s['batch_per_rank']} rows per rank ({s['ranks']} ranks for hpc_rlx, one thread a rank; PyTorch: "
                f"{s.get('torch_copies', 1)} independent processes at once, each one thread and {s['batch_per_rank']} "
                f"rows; the sides marked alone: one process alone), {s['optim']}, {s['dtype']}; LoRA r "
                f"{s['rank']}, alpha {s['alpha']} on {s['targets'].strip('[]').replace(',', ', ')}, the classifier "
                f"trained whole; {s['steps'] * s['timed_epochs']} timed steps a job after {s['steps']} warm-up "
                f"steps, {len(rounds)} rounds" + (f", {' '.join(s['extra'])}" if s.get("extra") else "")
                + _when(recs) + ":\n\n")
        table = []
        for side in [k for k in LORA_SIDES if k in rows]:
            rs = list(rows[side].values())
            wire = [r["wire_bytes_per_step"] for r in rs if "wire_bytes_per_step" in r]
            table.append([LORA_SIDES[side], f"{rs[0]['trainable']:,}", spread([r["step_ms"] for r in rs], ".0f"),
                          f"{statistics.mean(wire) / 2**20:.2f}" if wire else "-",
                          f"{_opt_bytes(rs[0]) / 2**20:.2f}"])
        out.append(head + _md(["side", "trainable values", "step ms", "wire MiB per step", "optimizer MiB per rank"],
                              table))
        goals = []

        def first(side, key):
            return next(iter(rows[side].values()))[key] if side in rows else None

        if first("full", "wire_bytes_per_step") and first("lora", "wire_bytes_per_step"):
            x = first("full", "wire_bytes_per_step") / first("lora", "wire_bytes_per_step")
            goals.append(["bytes on the wire per step, full / LoRA", f"{x:.0f}x", ">= 50x", "yes" if x >= 50 else "no"])
        if "full" in rows and "lora" in rows:
            x = _opt_bytes(rows["full"][min(rows["full"])]) / _opt_bytes(rows["lora"][min(rows["lora"])])
            goals.append(["optimizer bytes per rank, full / LoRA", f"{x:.0f}x", "-", "-"])
        copies = s.get("torch_copies", 1)
        for num, den, name, goal in (("lora", "full", "step time, LoRA / full (hpc_rlx)", 0.75),
                                     ("lora", "torch_lora", f"step time, LoRA: hpc_rlx {s['ranks']} ranks / PyTorch + "
                                                            f"PEFT, {copies} processes at once", 1.0),
                                     ("lora", "torch_lora_alone", f"step time, LoRA: hpc_rlx {s['ranks']} ranks / "
                                                                  "PyTorch + PEFT, 1 process alone", 1.0),
                                     ("lora_1rank", "torch_lora_alone", "step time, LoRA: hpc_rlx 1 rank alone / "
                                                                        "PyTorch + PEFT, 1 process alone", 1.0),
                                     ("full", "torch_full", "step time, full: hpc_rlx / PyTorch", None),
                                     ("torch_lora", "torch_full", "step time, LoRA / full (PyTorch + PEFT)", None)):
            ratios = _per_round(rows, num, den)
            if ratios:
                mean = statistics.mean(ratios)
                goals.append([name, spread(ratios, ".2f"), f"<= {goal}" if goal else "-",
                              ("yes" if mean <= goal else "no") if goal else "-"])
        out.append("\n" + _md(["figure", "mean (lowest-highest over the rounds)", "goal", "met"], goals))
    return "\n".join(out)


def _ms_nodes(rec: dict, key: str, name: str) -> str:
    """'ms' of one profile row, with '(k nodes)' where the record counts the op's nodes."""
    if name not in rec[key]:
        return "-"
    nodes = rec.get("op_nodes", {}).get(name) if key == "ops_ms" else None
    return f"{rec[key][name]:.1f}" + (f" ({nodes} nodes)" if nodes else "")


def lora_profile_table(records: list[dict], top: int = 12) -> str:
    """The profiled jobs: hpc_rlx's step parts (rank 0's mean ms per timed step in each traced
    span), the engine's ms per op type (forward + backward) and PyTorch's self CPU ms per aten op
    and step, the `top` largest of each and the sum of all; one column per side, the last record
    of each side."""
    sides = {r["side"]: r for r in records}
    out = []
    for title, key, group in (("step parts, hpc_rlx (rank 0's trace, ms per step)", "spans_ms", ("full", "lora")),
                              ("engine forward + backward by op type (ms per step, one process, one thread)", "ops_ms",
                               ("full", "lora")),
                              ("PyTorch by aten op (self CPU ms per step, one process, one thread)", "ops_ms",
                               ("torch_full", "torch_lora"))):
        cols = [sides[k] for k in group if k in sides and key in sides[k]]
        if not cols:
            continue
        names = sorted({n for r in cols for n in r[key]}, key=lambda n: -max(r[key].get(n, 0.0) for r in cols))
        rows = [[n] + [_ms_nodes(r, key, n) for r in cols] for n in names[:top]]
        if key == "ops_ms":
            rows.append([f"all {len(names)} op types"] + [f"{sum(r[key].values()):.1f}" for r in cols])
        if group[0].startswith("torch"):     # the same process's timed steps, before its profiler ran
            rows.append(["step, timed without the profiler"] + [f"{r['step_ms']:.1f}" for r in cols])
        out.append(f"{title}{_when(cols)}:\n\n" + _md(["", *(LORA_SIDES[r['side']] for r in cols)], rows))
    return "\n".join(out)


def tables_for(path: Path) -> str:
    records = read_records(path)
    kinds = {r["bench"] for r in records}
    make = {"streaming": streaming_table, "policies": policies_table, "lora": lora_table,
            "lora_profile": lora_profile_table}
    return "\n".join(make[k]([r for r in records if r["bench"] == k]) for k in sorted(kinds))


def rewrite(text: str, base: Path) -> str:
    return MARK.sub(lambda m: f"<!-- tables.py {m.group(1)} -->\n{tables_for(base / m.group(1))}"
                              f"<!-- end tables.py -->\n", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--readme", type=Path, help="rewrite the generated tables of this Markdown file")
    ap.add_argument("--check", action="store_true", help="with --readme: only say whether it is up to date")
    args = ap.parse_args()
    for path in args.files:
        print(tables_for(path))
    if args.readme:
        text = args.readme.read_text()
        new = rewrite(text, REPO)
        if args.check:
            if new != text:
                print(f"{args.readme}: tables differ from their raw files; run bench/tables.py --readme {args.readme}")
                return 1
            return 0
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
