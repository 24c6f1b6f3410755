"""`data.cache=memory` vs `stream`: peak resident memory and throughput, side by side, on a
synthetic image file several times larger than the memory the streamed jobs may use.

    .venv/bin/python bench/bench_stream.py                    # 1.25 GiB file, 320 MiB limit, 1 and 2 ranks
    .venv/bin/python bench/bench_stream.py --gb 4 --limit-mb 400 --ranks 2

The file holds uint8 images 3x32x32 (3 KiB a sample) and int64 labels, written under a temp
dir and deleted at the end. Every job trains the same MLP for `--steps` steps of one epoch
(train.max_steps; then the epoch's validation, 20% of the file, as the issue's job did), one
BLAS thread per rank (train.threads_per_rank=1: a 1-rank job would otherwise take both cores'
threads, which stall badly on a loaded machine). Per run it prints the largest peak RSS of its ranks (summary.json's
`peak_rss_bytes`, VmHWM), the cgroup's peak (every process of the job and the page cache it
charged), samples/s (hpc_rlx's `samples_per_s`: samples over step wall time, which with
stream includes any wait for the reader), the shard load time and whether the trained
parameters equal memory mode's bitwise.

Limited runs go into a child cgroup with a memory limit (tests/support/memory_limit.py: cgroup v2
`memory.max`, or v1 `memory.limit_in_bytes`; root only); without one they are left out, with
the reason. Memory mode under the limit is run once to show that the limit holds (killed).
The file was just written, so reads come from the page cache (charged to this script, not to
the job): this measures the library, not the disk.

Also printed: memory mode's footprint against its data, (peak - the same job's peak on a tiny
file) / (the rank's rows as stored + model state), the figure of issue 17 section 4.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MPIRUN, PYTHON, REPO, fmt_table, machine_note, one_thread_env  # noqa: E402

from tests.support.memory_limit import LimitUnavailable, MemoryLimit  # noqa: E402

SHAPE = (3, 32, 32)
MIB = 1 << 20


def write_images(path: Path, rows: int, seed: int = 0) -> Path:
    import h5py
    import numpy as np
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", (rows,) + SHAPE, dtype=np.uint8)
        for a in range(0, rows, 8192):
            b = min(rows, a + 8192)
            x[a:b] = rng.integers(0, 256, (b - a,) + SHAPE, dtype=np.uint8)
        f["y"] = rng.integers(0, 10, rows).astype(np.int64)
        f.attrs["num_classes"] = 10
    return path


def job(n: int, run_dir: Path, data: Path, steps: int, extra: list[str], limit: MemoryLimit | None,
        timeout: float, hidden: int = 64) -> dict:
    cmd = [MPIRUN, "-n", str(n), PYTHON, "-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "report.plots=false",
           "data=file", f"data.path={data}", "model=mlp", f"model.hidden=[{hidden}]", "train.batch_size=128",
           "train.threads_per_rank=1",
           "train.epochs=1", f"train.max_steps={steps}", "checkpoint=off", "optim.lr=0.00001"] + extra
    t0 = time.perf_counter()
    proc = subprocess.run(limit.wrap(cmd) if limit else cmd, cwd=REPO, env=one_thread_env(),
                          capture_output=True, text=True, timeout=timeout)
    out = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0,
           "cgroup_peak": limit.peak_bytes() if limit else None, "oom": limit.oom_killed() if limit else False}
    if proc.returncode != 0:
        out["tail"] = (proc.stdout + proc.stderr)[-600:]
        return out
    summary = json.loads((run_dir / "summary.json").read_text())
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rec = [r for r in recs if "event" not in r][-1]
    ranks = summary["ranks"]
    params = re.search(r"(\d+) parameters", proc.stdout)
    out.update(peak=max(r["peak_rss_bytes"] for r in ranks), shard=max(r["shard_bytes"] for r in ranks),
               buffers=max(r["buffer_bytes"] for r in ranks), load_s=max(r["data_s"] for r in ranks),
               samples_per_s=rec["samples_per_s"], val_loss=rec["val_loss"],
               params=int(params.group(1)) if params else 0)
    return out


def same_params(a: Path, b: Path) -> bool | None:
    import h5py
    import numpy as np
    if not (a / "model.h5").exists() or not (b / "model.h5").exists():
        return None
    with h5py.File(a / "model.h5", "r") as fa, h5py.File(b / "model.h5", "r") as fb:
        return set(fa) == set(fb) and all(np.array_equal(fa[k][...], fb[k][...]) for k in fa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.25, help="size of the synthetic file (GiB)")
    ap.add_argument("--limit-mb", type=int, default=320, help="memory limit of a streamed job, all ranks together")
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    ap.add_argument("--steps", type=int, default=300, help="training steps per job")
    ap.add_argument("--repeats", type=int, default=2, help="runs of the unlimited memory/stream pair (best kept)")
    ap.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width (a heavier step hides the reader)")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--keep", action="store_true", help="keep the file and the run directories")
    args = ap.parse_args()

    print(machine_note())
    tmp = Path(tempfile.mkdtemp(prefix="bench_stream_", dir=args.dir))
    try:
        rows = int(args.gb * (1 << 30)) // (3 * 32 * 32 + 8)
        t0 = time.perf_counter()
        big = write_images(tmp / "big.h5", rows)
        tiny = write_images(tmp / "tiny.h5", 2048)
        size = big.stat().st_size
        print(f"file: {rows} samples of uint8 {SHAPE}, {size / MIB:.0f} MiB (written in {time.perf_counter() - t0:.1f}s); "
              f"limit for streamed jobs: {args.limit_mb} MiB ({size / (args.limit_mb * MIB):.1f}x smaller than the file)")
        try:
            MemoryLimit(args.limit_mb * MIB)
            limit_note = None
        except LimitUnavailable as e:
            limit_note = str(e)
            print(f"no memory limit: {e}; limited runs left out")

        rows_out, results = [], {}
        for n in [int(r) for r in args.ranks.split(",")]:
            # the unlimited pair alternates, best of the repeats (as timeit); the rest runs once
            pair = [("memory", [], False), ("stream read", ["data.cache=stream"], False)]
            plan = [p for rep in range(args.repeats) for p in (pair if rep % 2 == 0 else pair[::-1])]
            plan += [("stream read", ["data.cache=stream"], True),
                     ("stream scatter", ["data.cache=stream", "data.distribution=scatter"], True)]
            if n == 1:
                plan.append(("memory", [], True))
            for i, (name, extra, limited) in enumerate(plan):
                if limited and limit_note:
                    continue
                run_dir = tmp / f"{name.replace(' ', '_')}_{n}{'_lim' if limited else ''}_{i}"
                if limited:
                    with MemoryLimit(args.limit_mb * MIB) as lim:
                        r = job(n, run_dir, big, args.steps, extra, lim, args.timeout, args.hidden)
                else:
                    r = job(n, run_dir, big, args.steps, extra, None, args.timeout, args.hidden)
                r["dir"] = run_dir
                best = results.get((name, n, limited))
                if best is None or r.get("samples_per_s", 0) > best.get("samples_per_s", 0):
                    results[(name, n, limited)] = r
                if r["rc"] != 0 and not r["oom"]:
                    print(f"{name} on {n} rank(s) failed:\n{r.get('tail', '')}")
            for (name, m, limited), r in results.items():
                if m != n:
                    continue
                ref = results.get(("memory", n, False))
                same = same_params(ref["dir"], r["dir"]) if (name != "memory" and ref) else None
                status = "ok" if r["rc"] == 0 else ("killed (OOM)" if r["oom"] else f"rc={r['rc']}")
                rows_out.append([name, n, f"{args.limit_mb}" if limited else "-", status,
                                 r.get("peak", 0) / MIB if r["rc"] == 0 else None,
                                 r["cgroup_peak"] / MIB if r["cgroup_peak"] else None,
                                 r.get("buffers", 0) / MIB if r["rc"] == 0 else None,
                                 r.get("load_s"), r.get("samples_per_s"), r.get("val_loss"),
                                 {True: "yes", False: "NO", None: "-"}[same]])
        print()
        print(fmt_table(["mode", "ranks", "limit MiB", "status", "peak RSS/rank MiB", "cgroup peak MiB",
                         "buffers MiB", "load s", "samples/s", "val_loss", "== memory"], rows_out))
        for n in [int(r) for r in args.ranks.split(",")]:
            mem, stream = results.get(("memory", n, False)), results.get(("stream read", n, False))
            if mem and stream and mem["rc"] == 0 and stream["rc"] == 0:
                print(f"{n} rank(s): stream/memory throughput {stream['samples_per_s'] / mem['samples_per_s']:.3f} "
                      f"(best of {args.repeats}), peak RSS {stream['peak'] / MIB:.0f} vs {mem['peak'] / MIB:.0f} MiB")

        # memory mode against its data: the same 1-rank job on a tiny file is the baseline
        base = job(1, tmp / "tiny_1", tiny, args.steps, [], None, args.timeout, args.hidden)
        r = results.get(("memory", 1, False))
        if r and r["rc"] == 0 and base["rc"] == 0:
            model = r["params"] * 4 * 3      # float32 parameters, their gradient bucket, momentum
            excess = r["peak"] - base["peak"]
            print(f"\nmemory mode, 1 rank: peak {r['peak'] / MIB:.0f} MiB, tiny-file job {base['peak'] / MIB:.0f} MiB, "
                  f"shard as stored {r['shard'] / MIB:.0f} MiB, model state {model / MIB:.1f} MiB: "
                  f"(peak - tiny) / (shard + model) = {excess / (r['shard'] + model):.3f} (target <= 1.2)")
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
