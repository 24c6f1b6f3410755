"""Training runs on a GPU machine: accuracy, lanes and the bucket path, as a Markdown table.

    python bench/gpu/train_check.py --set single    # 1 rank: device=cpu, cuda, all
    python bench/gpu/train_check.py --set pair      # 2 ranks sharing GPU 0: cuda_aware auto/false, bf16 wire

Each run is `mpirun -n N python -m hpc_rlx` on the digits (the default job: MLP, 20 epochs,
batch 64) with its own timeout. A failed run becomes a row that says so; the exit status is
1 when any run failed or missed the accuracy bar (val_accuracy >= 0.95, the CPU job's level).
Options: --mpirun (default: the one next to this Python, else on PATH), --epochs, --timeout,
--out FILE (append the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACCURACY_BAR = 0.95

# (name, ranks, overrides, expectations). Expectations keep a silent fallback from passing
# as a GPU result: `gpu`/`cpu` lane present (from the `lanes:` log line), and the bucket path
# the run must report ("staged"; None: either path, whichever the MPI supports).
SETS = {
    "single": [
        ("cpu", 1, ["device=cpu"], {"gpu": False, "cpu": True}),
        ("cuda", 1, ["device=cuda"], {"gpu": True, "cpu": False}),
        ("all (GPU + CPU lane)", 1, ["device=all"], {"gpu": True, "cpu": True}),
    ],
    "pair": [
        ("2 ranks, cuda_aware=auto", 2, ["device=cuda", "comm.cuda_aware=auto"],
         {"gpu": True, "cpu": False}),
        ("2 ranks, cuda_aware=false (staged)", 2, ["device=cuda", "comm.cuda_aware=false"],
         {"gpu": True, "cpu": False, "path": "staged"}),
        ("2 ranks, staged, wire bfloat16", 2, ["device=cuda", "comm.cuda_aware=false",
                                               "comm.wire_dtype=bfloat16"],
         {"gpu": True, "cpu": False, "path": "staged"}),
        ("2 ranks, all (GPU + CPU lane)", 2, ["device=all"], {"gpu": True, "cpu": True}),
    ],
}


def unmet(row: dict, expect: dict) -> list[str]:
    """What a finished run shows that its expectations rule out (empty: as expected)."""
    lanes, bucket = row.get("lanes", "?"), row.get("bucket", "?")
    problems = []
    for kind in ("gpu", "cpu"):
        present = ("cuda" if kind == "gpu" else "cpu") in lanes
        if present != expect[kind]:
            problems.append(f"{'a' if expect[kind] else 'no'} {kind.upper()} lane expected, lanes: {lanes}")
    if expect.get("path") and f"path {expect['path']}" not in bucket:
        problems.append(f"bucket path {expect['path']!r} expected: {bucket}")
    return problems


def default_mpirun() -> str:
    here = Path(sys.executable).with_name("mpirun")
    return str(here) if here.exists() else (shutil.which("mpirun") or "mpirun")


def run_one(mpirun: str, n: int, overrides: list[str], data: str, epochs: int, timeout: float,
            work: Path, name: str) -> dict:
    run_dir = work / name.replace(" ", "_").replace("=", "-").replace(",", "").replace("(", "").replace(")", "")
    cmd = [mpirun, "-n", str(n), sys.executable, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}",
           f"data.path={data}", f"train.epochs={epochs}", "checkpoint=off", "report.plots=false",
           "train.log_every_s=1000"] + overrides
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", _text(e.stdout), _text(e.stderr)
    wall = time.perf_counter() - t0
    row = {"name": name, "ranks": n, "rc": rc, "wall_s": wall, "overrides": overrides}
    lanes = [ln.split("lanes: ", 1)[1] for ln in out.splitlines() if "] lanes: " in ln]
    bucket = [ln.split("] ", 1)[1] for ln in out.splitlines() if "] bucket on " in ln]
    row["lanes"] = lanes[0] if lanes else "?"
    row["bucket"] = bucket[0] if bucket else "?"
    if rc != 0:
        row["error"] = (err.strip().splitlines() or out.strip().splitlines() or ["no output"])[-1][:200]
        sys.stderr.write(f"--- {name}: rc={rc}\n{out[-3000:]}\n{err[-3000:]}\n")
        return row
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    last = metrics[-1]
    row["val_accuracy"] = last.get("val_accuracy")
    # the first epoch carries start-up (imports, kernel compilation): rate the others
    rates = [m["samples_per_s"] for m in metrics[1:] if m.get("samples_per_s")] or \
            [m["samples_per_s"] for m in metrics if m.get("samples_per_s")]
    row["samples_per_s"] = sorted(rates)[len(rates) // 2] if rates else None
    row["comm_s_per_epoch"] = sum(m.get("comm_s") or 0.0 for m in metrics) / len(metrics)
    shares = {}
    for r in summary.get("ranks") or []:
        total = sum((r.get("lane_samples") or {}).values()) or 1
        for lane, s in (r.get("lane_samples") or {}).items():
            shares.setdefault(lane, []).append(s / total)
    row["lane_share"] = {k: sum(v) / len(v) for k, v in shares.items()}
    return row


def _text(b) -> str:
    if b is None:
        return ""
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def table(rows: list[dict]) -> str:
    lines = ["| run | ranks | val acc | samples/s (median epoch) | comm s/epoch | lane share of samples | bucket path |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["rc"] != 0:
            lines.append(f"| {r['name']} | {r['ranks']} | FAILED ({r['rc']}): {r.get('error', '')} | | | | |")
            continue
        share = ", ".join(f"{k} {v:.0%}" for k, v in r["lane_share"].items())
        sps = f"{r['samples_per_s']:,.0f}" if r["samples_per_s"] else "-"
        name = r["name"] + "".join(f" **NOT AS EXPECTED: {p}**" for p in r.get("unmet", []))
        lines.append(f"| {name} | {r['ranks']} | {r['val_accuracy']:.4f} | {sps} | "
                     f"{r['comm_s_per_epoch']:.3f} | {share} | {r['bucket']} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=sorted(SETS), required=True)
    ap.add_argument("--mpirun", default=default_mpirun())
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--out", default=None, help="append the Markdown table to this file")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO))
    from hpc_rlx.data.prepare import ensure_prepared

    work = Path(tempfile.mkdtemp(prefix="hpc_rlx_gpu_train_"))
    data = ensure_prepared(str(work / "digits.h5"), "digits")
    rows = []
    for name, n, overrides, expect in SETS[args.set]:
        row = run_one(args.mpirun, n, overrides, data, args.epochs, args.timeout, work, name)
        row["unmet"] = unmet(row, expect) if row["rc"] == 0 else []
        rows.append(row)
        print(f"{name}: rc={row['rc']} val_acc={row.get('val_accuracy')} lanes={row['lanes']} "
              f"{row['bucket']} ({row['wall_s']:.0f}s)", flush=True)
    text = f"#### Training runs ({args.set}; digits MLP, {args.epochs} epochs, batch 64)\n\n" + table(rows) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in rows if r["rc"] != 0 or (r.get("val_accuracy") or 0.0) < ACCURACY_BAR or r["unmet"]]
    for r in bad:
        print(f"NOT OK: {r['name']} (rc={r['rc']}, val_accuracy={r.get('val_accuracy')}"
              + "".join(f"; {p}" for p in r["unmet"]) + ")")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
