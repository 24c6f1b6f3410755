"""The raw results of bench_streaming.py and bench_policies.py (JSON lines, one record per job,
kept under bench/results/) and the Markdown tables made from them: means over the seeds, with
the spread (lowest-highest) beside each mean.

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


def tables_for(path: Path) -> str:
    records = read_records(path)
    kinds = {r["bench"] for r in records}
    make = {"streaming": streaming_table, "policies": policies_table}
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
