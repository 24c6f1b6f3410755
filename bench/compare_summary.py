"""The summary table of bench/compare_checkouts.sh: per figure, the median over the rounds of the
old and of the new checkout, and their ratio, oriented so that >= 1 means the new code is not
slower: new/old for rates (samples/s), old/new for times (ms) and for time ratios (engine/torch,
bucket/raw1). A ratio below the threshold (default 0.97) is flagged. Then the geometric means
of those ratios over all figures and over each group (engine, collective, full path), each
figure once: the cpu-time twins of the engine's wall times and the ratios derived from other
figures (engine/torch, bucket/raw1) are left out. A mean below its bar (all figures 0.98, each
group 0.97) is flagged.

    .venv/bin/python bench/compare_summary.py OUT_DIR [--threshold 0.97]

OUT_DIR holds one file per run, as compare_checkouts.sh writes them (SIDE is old or new, I the
round): engine.SIDE.I.txt (bench_engine.py's output), collective.SIDE.I.txt
(bench_collective.py's) and full.POLICY.nN.SIDE.I.json (the hpc_rlx side of bench_ddp.py);
further tries of a run in the same round insert `.tK` before SIDE.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

SIDES = ("old", "new")
RATE, TIME = "rate", "time"          # higher is better / lower is better
# A figure's key is (name, kind, group); group None: not in the geometric means, as it repeats
# another figure (a cpu-time twin) or is derived from others (engine/torch, bucket/raw1).
ENGINE, COLLECTIVE, FULL = "engine", "collective", "full path"
GROUPS = (ENGINE, COLLECTIVE, FULL)
BAR_ALL, BAR_GROUP = 0.98, 0.97

# bench_engine.py: "  engine         wall best    9.71 ms  median    9.80 ms  cpu best    9.70 ms ..."
CONTENDER = re.compile(r"^\s+(\S+)\s+wall best\s+([\d.]+) ms\s+median\s+([\d.]+) ms\s+cpu best\s+([\d.]+) ms")
ENGINES = ("engine", "engine-mkl")                 # hpc_rlx's contenders; torch is the yardstick
BUCKETS = ("bucket", "bucket 1 call", "bucket shm")   # bench_collective.py's hpc_rlx columns


def case_name(title: str) -> str:
    """A bench_engine case by its leading words: `MLP`, `CNN`, `transformer LM`."""
    words = []
    for word in title.replace(",", " ").split():
        if any(c.isdigit() or c == "=" for c in word):
            break
        words.append(word)
    return " ".join(words) or title


def engine_figures(text: str) -> dict:
    """Per case, each hpc_rlx engine's best wall and cpu step time and its best wall time over
    torch's (the same machine, moments apart: the steadier figure on a busy host)."""
    cases: dict[str, dict] = {}          # case -> contender -> (best wall, cpu best) ms
    case = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            case = None if line.startswith("numpy ") else case_name(line)
            continue
        m = CONTENDER.match(line)
        if m and case is not None:
            cases.setdefault(case, {})[m.group(1)] = (float(m.group(2)), float(m.group(4)))
    figures = {}
    for case, contenders in cases.items():
        for name in ENGINES:
            if name not in contenders:
                continue
            wall, cpu = contenders[name]
            figures[(f"engine {case}: {name} step, best wall (ms)", TIME, ENGINE)] = wall
            figures[(f"engine {case}: {name} step, best cpu (ms)", TIME, None)] = cpu
            if contenders.get("torch", (0.0,))[0] > 0:
                figures[(f"engine {case}: {name}/torch, best wall", TIME, None)] = wall / contenders["torch"][0]
    return figures


def collective_figures(text: str) -> dict:
    figures, header = {}, None
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or set(line.strip()) <= {"-", " "}:
            continue
        if line.strip().startswith("MiB"):
            header = re.split(r"\s{2,}", line.strip())
            continue
        cells = line.split()
        if header is None or len(cells) != len(header):
            continue
        row = dict(zip(header, cells))
        for name in BUCKETS:
            value = row.get(f"{name} ms", "-")
            if value != "-":
                figures[(f"collective {row['MiB']} MiB: {name} (ms)", TIME, COLLECTIVE)] = float(value.replace(",", ""))
        if row.get("bucket/raw1", "-") != "-":
            figures[(f"collective {row['MiB']} MiB: bucket/raw1", TIME, None)] = float(row["bucket/raw1"])
    return figures


def full_figures(path: Path, policy: str, n: str) -> dict:
    out = json.loads(path.read_text())
    figures = {(f"full path, policy={policy}, {n} rank(s): samples/s", RATE, FULL): out.get("samples_per_s")}
    if out.get("p25_samples_per_s") is not None:
        figures[(f"full path, policy={policy}, {n} rank(s): p25 step samples/s", RATE, FULL)] = out["p25_samples_per_s"]
    return figures


def collect(out_dir: Path) -> tuple[dict, int]:
    """{(figure, kind, group): {side: [value per round]}}, the figures in the order their runs were
    written, and the number of rounds seen. A round may hold several tries of a run (a file
    name with `.tK` before the side): the round's value is the best of them (the highest rate,
    the lowest time), as one run's own figures are the best of its repeats."""
    per_round: dict = {}
    runs = sorted((p for p in out_dir.iterdir() if p.suffix in (".txt", ".json")),
                  key=lambda p: (p.stat().st_mtime_ns, p.name))
    for p in runs:
        parts = p.name.split(".")
        if len(parts) >= 5 and re.fullmatch(r"t\d+", parts[-4]):
            parts = parts[:-4] + parts[-3:]          # a try of the round: kept with the others
        if len(parts) < 4 or parts[-3] not in SIDES or not parts[-2].isdigit():
            continue
        side, round_ = parts[-3], int(parts[-2])
        if parts[0] == "engine":
            figures = engine_figures(p.read_text())
        elif parts[0] == "collective":
            figures = collective_figures(p.read_text())
        elif parts[0] == "full" and len(parts) == 6:
            figures = full_figures(p, parts[1], parts[2].lstrip("n"))
        else:
            continue
        for key, v in figures.items():
            if v is not None:
                per_round.setdefault(key, {s: {} for s in SIDES})[side].setdefault(round_, []).append(v)
    values, rounds = {}, set()
    for key, by_side in per_round.items():
        best = max if key[1] == RATE else min
        values[key] = {s: [best(tries) for _, tries in sorted(by_round.items())] for s, by_round in by_side.items()}
        rounds.update(r for by_round in by_side.values() for r in by_round)
    return values, len(rounds)


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}" if abs(v) < 10 else f"{v:.2f}"


def ratios(values: dict) -> dict:
    """{key: (old median, new median, ratio)}: ratio >= 1 when the new code is not slower (None
    where a side has no value)."""
    out = {}
    for key, by_side in values.items():
        old = statistics.median(by_side["old"]) if by_side["old"] else None
        new = statistics.median(by_side["new"]) if by_side["new"] else None
        ratio = None
        if old and new:
            ratio = new / old if key[1] == RATE else old / new
        out[key] = (old, new, ratio)
    return out


def geometric_means(ratio_of: dict) -> dict:
    """{"all" and each group: (geometric mean of its figures' ratios or None, [figure names])},
    each figure once: a key whose group is None is left out, and so is a figure without a ratio."""
    members: dict[str, list] = {"all": [], **{g: [] for g in GROUPS}}
    for (figure, _kind, group), ratio in ratio_of.items():
        if group is None or ratio is None:
            continue
        members["all"].append((figure, ratio))
        members[group].append((figure, ratio))
    return {name: (statistics.geometric_mean([r for _, r in found]) if found else None,
                   [f for f, _ in found])
            for name, found in members.items()}


def means_lines(means: dict) -> tuple[list[str], int]:
    """The means, each against its bar ('<' below it), then which figures each one covers; and
    how many means are below their bar."""
    lines = [f"== geometric means of the ratios, each figure once (the cpu-time twins and the derived "
             f"ratios engine/torch and bucket/raw1 left out); '<' marks a mean below its bar"]
    low = 0
    for name, (mean, figures) in means.items():
        bar = BAR_ALL if name == "all" else BAR_GROUP
        below = mean is not None and mean < bar
        low += below
        shown = "-" if mean is None else f"{mean:.3f}"
        lines.append(f"{name + ' figures' if name == 'all' else name:<12}  {shown:>5}  (bar {bar:.2f}, "
                     f"{len(figures)} figures)  {'<' if below else ''}".rstrip())
    lines.append(f"{low} of {len(means)} means below their bar" if low else "every mean at or above its bar")
    for name in GROUPS:
        lines.append(f"-- {name} group:")
        lines.extend(f"   {figure}" for figure in means[name][1])
    return lines, low


def summary(values: dict, rounds: int, threshold: float) -> tuple[list[str], int]:
    lines = [f"== summary: median over {rounds} round(s) of each side; ratio = new/old for rates "
             f"(samples/s), old/new for times (ms) and time ratios (engine/torch, bucket/raw1): "
             f">= 1.00 means the new code is not slower; '<' marks a ratio below {threshold:.2f}"]
    rows, low = [], []
    ratio_of = ratios(values)
    for (figure, _kind, _group), (old, new, ratio) in ratio_of.items():
        flag = "<" if ratio is not None and ratio < threshold else ""
        if flag:
            low.append(figure)
        rows.append((figure, fmt(old), fmt(new), "-" if ratio is None else f"{ratio:.3f}", flag))
    header = ("figure", "old", "new", "ratio", "")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    for r in [header, *rows]:
        lines.append(f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}  {r[4]}"
                     .rstrip())
    compared = sum(1 for r in rows if r[3] != "-")
    if low:
        lines.append(f"{len(low)} of {compared} figures below {threshold:.2f} (marked '<')")
    else:
        lines.append(f"all {compared} figures at or above {threshold:.2f}")
    mean_lines, _ = means_lines(geometric_means({k: r for k, (_, _, r) in ratio_of.items()}))
    return lines + mean_lines, len(low)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--threshold", type=float, default=0.97)
    args = ap.parse_args(argv)
    values, rounds = collect(args.out_dir)
    lines, _ = summary(values, rounds, args.threshold)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
