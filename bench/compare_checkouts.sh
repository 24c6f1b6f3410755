#!/usr/bin/env bash
# Old vs new code, alternated in one run (the first side swapping every round): bench_engine, bench_collective and the hpc_rlx side of
# bench_ddp (its run_hpc: policy=sync at 1 and 2 ranks, policy=cadence and policy=async at 2),
# each run from each checkout with the same Python (one BLAS thread; every run TRIES=2 times a
# side per round, the best kept), then a summary table: per
# figure the median over the rounds of each side and their ratio, >= 1 meaning the new code is
# not slower, a ratio below 0.97 flagged, then the geometric means over all figures and over the
# engine, collective and full-path groups against their bars (bench/compare_summary.py). The load
# average is printed at the start, at each round and at the end: a busy machine shows there.
#   bash bench/compare_checkouts.sh OLD_CHECKOUT NEW_CHECKOUT [ROUNDS]      (ROUNDS: default 3)
# e.g. git worktree add /tmp/old 7bd88fd && bash bench/compare_checkouts.sh /tmp/old .
# FULL='sync:1 sync:2 cadence:2 async:2' chooses the full-path runs (policy:ranks); OUT=DIR keeps
# every run's output there (default: a temporary directory, removed at the end).
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); ROUNDS=${3:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-$(cd "$HERE/.." && pwd)/.venv/bin/python}
FULL=${FULL:-sync:1 sync:2 cadence:2 async:2}
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; KEEP=1; else OUT=$(mktemp -d); KEEP=0; fi
OUT=$(cd "$OUT" && pwd)
[ "$KEEP" = 1 ] || trap 'rm -rf "$OUT"' EXIT
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# Each side runs from its own directory with PYTHONPATH on it: the venv's editable install of one
# checkout must not be what the other side imports. Checked first, in this process and in a rank
# that the bench scripts' own mpirun starts.
label() { if [ "$1" = "$OLD" ]; then echo old; else echo new; fi; }
side_run() { local side=$1; shift; (cd "$side" && PYTHONPATH="$side" "$@"); }
for side in "$OLD" "$NEW"; do
  where=$(side_run "$side" timeout 300 "$PY" -c '
import sys
sys.path.insert(0, "bench")
import hpc_rlx
from _common import mpirun, one_thread_env
rank = mpirun(1, ["-c", "import hpc_rlx; print(hpc_rlx.__file__)"], timeout=240, env=one_thread_env())
print(hpc_rlx.__file__, rank.split()[-1])')
  echo "hpc_rlx of $(label "$side") ($side): $where"
  for f in $where; do
    case "$f" in
      "$side"/*) ;;
      *) echo "error: the $(label "$side") side imports $f, not its own hpc_rlx" >&2; exit 1;;
    esac
  done
done

# The side that runs first changes every round: a machine's drift within a round (another
# tenant, memory reclaim after the previous run) must not always fall on the same side.
sides() { if [ $(( $1 % 2 )) = 1 ]; then echo "$OLD $NEW"; else echo "$NEW $OLD"; fi; }
load() { echo "== $1, load average $(cut -d' ' -f1-3 /proc/loadavg)"; }
uptime
# A round runs the engine, the collectives and each full-path job TRIES times a side
# (alternated, the first side swapping every try: old new new old with 2) and keeps each figure's best, as one run keeps the best of its
# repeats: a slow spell of the machine (raw MPI 2-3x slower for a whole run, seen here) then
# costs a try, not the round.
TRIES=${TRIES:-2}
try_name() { if [ "$1" = 1 ]; then echo ""; else echo ".t$1"; fi; }
for i in $(seq "$ROUNDS"); do
  load "round $i (engine, collective)"
  for k in $(seq "$TRIES"); do
    for side in $(sides $((i + k - 1))); do
      s=$(label "$side")
      echo "== engine $s $side (round $i, try $k)"
      f="$OUT/engine$(try_name "$k").$s.$i.txt"
      side_run "$side" timeout 600 "$PY" bench/bench_engine.py > "$f" 2>&1 || { tail -n 20 "$f"; exit 1; }
      grep -E "^[^ ]|engine |ratio" "$f" || true
    done
  done
  for k in $(seq "$TRIES"); do
    for side in $(sides $((i + k - 1))); do
      s=$(label "$side")
      echo "== collective $s $side (round $i, try $k)"
      f="$OUT/collective$(try_name "$k").$s.$i.txt"
      side_run "$side" timeout 600 "$PY" bench/bench_collective.py --sizes 1,8,32 --repeats 8 > "$f" 2>&1 \
        || { tail -n 20 "$f"; exit 1; }
      grep -v "^#" "$f" || true
    done
  done
done

# The inline code runs the same in every checkout: run_hpc(n, data, epochs, workdir, extra) takes
# the policy as an override in both. Windowed policies trace windows, not steps, so their
# 25th-percentile step rate is left out (run_hpc would fail on it).
echo "== full path (hpc_rlx side of bench_ddp), samples/s"
for i in $(seq "$ROUNDS"); do
  load "round $i (full path)"
  for run in $FULL; do
    policy=${run%%:*}; n=${run##*:}
    for k in $(seq "$TRIES"); do
    for side in $(sides $((i + k - 1))); do
      s=$(label "$side")
      rate=$(side_run "$side" timeout 900 "$PY" -c '
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import bench_ddp as b
n, policy, work, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
p25 = b.p25_step_samples_per_s

def p25_of_steps(run_dir, global_batch):
    try:
        return p25(run_dir, global_batch)
    except (IndexError, KeyError, ValueError):       # no "step" spans: a windowed policy
        return None

b.p25_step_samples_per_s = p25_of_steps
work.mkdir(parents=True, exist_ok=True)
data = b.prepare_synthetic(work / "syn.h5", b.PER_RANK_BATCH * 2 * 24, b.FEATURES, b.CLASSES)
res = b.run_hpc(n, data, 3, work, [f"policy={policy}"])
out.write_text(json.dumps({k: res.get(k) for k in ("samples_per_s", "p25_samples_per_s", "step_ms")}))
p = res.get("p25_samples_per_s")
print("%.0f (p25 step: %s)" % (res["samples_per_s"], "-" if p is None else "%.0f" % p))' \
        "$n" "$policy" "$OUT/work.$s" "$OUT/full.$policy.n$n$(try_name "$k").$s.$i.json" | tail -n 1)
      echo "round $i, try $k, $n rank(s), policy=$policy, $s $side: $rate"
    done
    done
  done
done
uptime
"$PY" "$HERE/compare_summary.py" "$OUT"
[ "$KEEP" = 0 ] || echo "every run's output: $OUT"
