"""Shared helpers for the benchmark scripts: launching jobs with timeouts, preparing data,
reading hpc_rlx's metrics, and printing tables."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
_local_mpirun = Path(PYTHON).with_name("mpirun")
MPIRUN = str(_local_mpirun) if _local_mpirun.exists() else (shutil.which("mpirun") or "mpirun")

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def one_thread_env(extra: dict | None = None) -> dict:
    """One BLAS/OpenMP thread per process on both sides of every comparison."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"})
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def _checked(start, what: str, on_timeout=None) -> str:
    """The stdout of the finished process ``start()`` returns; on failure or timeout (after
    ``on_timeout``), stop the benchmark with its output, ``what`` naming the command."""
    try:
        proc = start()
    except subprocess.TimeoutExpired as e:
        if on_timeout is not None:
            on_timeout()
        raise SystemExit(f"timed out after {e.timeout}s: {what}\n{(e.stdout or '')[-2000:]}"
                         f"\n{(e.stderr or '')[-2000:]}")
    if proc.returncode != 0:
        raise SystemExit(f"failed (rc={proc.returncode}): {what}\n--- stdout ---\n"
                         f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
    return proc.stdout


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | None = None) -> str:
    """Run a command; on failure or timeout, stop the benchmark with its output."""
    return _checked(lambda: subprocess.run(cmd, cwd=cwd or REPO, env=env or one_thread_env(), capture_output=True,
                                           text=True, timeout=timeout), " ".join(cmd))


def mpirun(n: int, args: list[str], timeout: float, env: dict | None = None) -> str:
    return run([MPIRUN, "-n", str(n), PYTHON] + list(args), timeout=timeout, env=env)


def emulated_nodes(nodes: int, workdir: Path):
    """An `EmulatedCluster` of `nodes` hosts (tests/support/netns_cluster.py: network namespaces,
    needs root), torn down on exit; the benchmark stops with the reason where it cannot start.
    SIGTERM (a timeout's kill) leaves through the same exit, so no namespace outlives the run."""
    import signal

    from tests.support.netns_cluster import EmulatedCluster, can_emulate
    why = can_emulate()
    if why:
        raise SystemExit(f"cannot emulate nodes here: {why}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return EmulatedCluster(nodes, workdir)


def mpiexec_on_nodes(cluster, hosts: dict, args: list[str], timeout: float, env: dict | None = None) -> str:
    """`python ARGS` under MPICH's `mpiexec` across emulated nodes (`hosts`: {'node1': ranks,
    ...}), started on node1, as `mpirun` runs it on this host; on failure or timeout, stop the
    benchmark with the job's output."""
    cmd = cluster.mpich_cmd(str(Path(PYTHON).with_name("mpiexec")), hosts, [PYTHON] + list(args))
    return _checked(lambda: cluster.on("node1", cmd, timeout=timeout, env=env or one_thread_env(), cwd=REPO),
                    f"on {hosts}: {' '.join(args)}", on_timeout=cluster.kill_everything)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result_line(stdout: str, tag: str = "RESULT") -> dict:
    for line in stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise SystemExit(f"no {tag} line in output:\n{stdout[-2000:]}")


def prepare_synthetic(path: Path, samples: int, features: int, classes: int = 10) -> Path:
    from hpc_rlx.data.prepare import prepare_synthetic as prep
    if not path.exists():
        prep(path, samples=samples, features=features, classes=classes, seed=0)
    return path


def hpc_throughput(run_dir: Path, global_batch: int, skip_epochs: int = 1) -> dict:
    """Samples/s over the epochs after the warm-up ones, from hpc_rlx's own metric
    `samples_per_s` (samples / step wall time, where a step is batch gather + forward/backward
    + allreduce + optimizer, timed on rank 0)."""
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    use = recs[skip_epochs:] or recs
    wall = samples = comm = compute = 0.0
    steps = 0
    for r in use:
        n = r["steps"] * global_batch
        wall += n / r["samples_per_s"]
        samples += n
        steps += r["steps"]
        comm += r["comm_s"]
        compute += r["compute_s"]
    return {"samples_per_s": samples / wall, "comm_frac": comm / wall, "compute_frac": compute / wall,
            "epochs": len(use), "steps": steps, "step_ms": 1e3 * wall / steps}


def fmt_table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3f}" if abs(v) < 1 else f"{v:.2f}"
    return str(v)


def median(xs):
    return statistics.median(xs) if xs else None


def git_commit() -> str:
    """The checkout's short commit, for a raw result's record ("?" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine_note() -> str:
    import platform
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.node()}: {cores} cores, load average {load:.2f}, python {platform.python_version()}"


def timed_torch_epochs(model, opt, lossf, x, y, batch: int, steps: int, epochs: int, rows: int, gen):
    """A plain PyTorch training loop timed per step: each epoch a fresh permutation of ``rows``
    samples, ``steps`` steps of ``batch``. Returns (wall seconds per epoch, step seconds of the
    epochs after the first, the last loss)."""
    import torch
    walls, step_times, loss = [], [], None
    for ep in range(epochs):
        perm = torch.randperm(rows, generator=gen)
        wall = 0.0
        for s in range(steps):
            t0 = time.perf_counter()
            idx = perm[s * batch:(s + 1) * batch]
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            loss = lossf(model(xb), yb)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            wall += dt
            if ep > 0:
                step_times.append(dt)
        walls.append(wall)
    return walls, step_times, loss


def p25_step_samples_per_s(run_dir: Path, global_batch: int) -> float:
    """Samples/s from the 25th-percentile `step` span of rank 0's trace, warm-up epoch left out
    (robust to other jobs on a shared machine)."""
    doc = json.loads((run_dir / "trace.json").read_text())
    steps_per_epoch = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["steps"]
    durs = sorted(e["dur"] * 1e-6 for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 0
                  and e["name"] == "step" and e["args"]["step"] >= steps_per_epoch)
    return global_batch / percentile(durs, 25)


def percentile(sorted_xs: list[float], q: float) -> float:
    k = (len(sorted_xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)

