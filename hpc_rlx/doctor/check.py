"""Preflight check: what this MPI job would run on, and what would make training slow or hang.

    python -m hpc_rlx.doctor                        # this machine, one rank
    mpirun -n 4 python -m hpc_rlx.doctor            # exactly as you would launch training
    srun -n 8 python -m hpc_rlx.doctor              # inside salloc / a batch job
    python -m hpc_rlx.doctor --run-dir /scratch/me/outputs --json --strict
    mpirun -n 4 python -m hpc_rlx.doctor train.threads_per_rank=2   # with training's overrides

Every rank collects its own facts (host, cores it may use, BLAS threads, GPUs, run directory);
rank 0 gathers them and prints one report with plain-word warnings. Exit status: 0, or 1 with
--strict when there is any warning, or 2 (with one error line) when training with these settings
would stop at start-up (device=cuda on a rank without a usable GPU). The doctor only reads, except for one short-lived probe file
per rank in the run directory (or its nearest existing parent), removed before it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

from hpc_rlx.comm.node_memory import SHM_DIR, largest_shared_bucket
from hpc_rlx.base.topology import node_layout, rank_span
from hpc_rlx.resilience.ulfm import before_mpi_starts
from hpc_rlx.base.cuda_mpi import doctor_summary
from hpc_rlx.doctor.config import split_run_dir, training_settings
from hpc_rlx.doctor.probe import (
    SOFTWARE_KEYS,
    collect_local,
    data_file_problem,
    gpu_check,
    lane_problem,
    mpi_facts,
    nearest_existing,
    safe_call,
)
from hpc_rlx.doctor.threads import THREAD_ENV, host_train_threads, settings_note, thread_warnings

# ==================================================================================================
# Analysis and report (pure: plain dicts in, strings out)
# ==================================================================================================

MIB = 1024 * 1024
# below this largest shared bucket a rank, typical models' sums fall back to MPI's Allreduce
SHM_WARN_BUCKET = 64 * MIB


def shm_fit(recs: list[dict]) -> tuple[int, int] | None:
    """(free bytes in /dev/shm, the largest bucket a rank the node's shared-memory sum takes)
    for one node's records, or None where /dev/shm was not measured."""
    free = recs[0].get("shm_free")
    return None if free is None else (free, largest_shared_bucket(free, len(recs)))


def by_host(records: list[dict]) -> dict[str, list[dict]]:
    hosts: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        hosts[r["host"]].append(r)
    return dict(hosts)


def analyse(records: list[dict], *, shared: dict | None = None, cwd_files: dict | None = None,
            settings: dict | None = None) -> list[str]:
    """Plain-word warnings about what would make a run slow, fail or hang. `settings`: the
    training config's thread-related values (`threads_per_rank`, `cpu_lanes`)."""
    warnings = []
    size = records[0]["size"] if records else 1
    for host, recs in sorted(by_host(records).items()):
        warnings += _host_warnings(host, recs, settings)
    # srun whose PMI does not match the MPI library starts N lone rank-0 processes
    for r in records:
        step_tasks = r["env"].get("SLURM_STEP_NUM_TASKS", "")
        if size == 1 and step_tasks.isdigit() and int(step_tasks) > 1:
            warnings.append(
                f"srun started {step_tasks} tasks but MPI sees a world of 1: srun's PMI plugin "
                f"(--mpi={r['env'].get('SLURM_MPI_TYPE', 'site default')}) does not match this MPI "
                "library, so every task would train alone. Use srun --mpi=pmi2 (or pmix), or "
                "mpirun; slurm/train.sh picks one that works.")
            break
    # every rank must run the same software
    for key in SOFTWARE_KEYS:
        values = defaultdict(list)
        for r in records:
            values[str(r.get(key))].append(r["rank"])
        if len(values) > 1:
            detail = "; ".join(f"{v} on ranks {rank_span(rs)}" for v, rs in sorted(values.items()))
            warnings.append(f"ranks run different {key}: {detail}. Mixed software across nodes can "
                            "hang or crash collectives: use one environment on every node.")
    # GPUs
    failed = [r for r in records if isinstance(r.get("gpu_check"), dict) and r["gpu_check"]["problem"]]
    if failed:
        r = failed[0]
        warnings.append(
            f"GPU {r['gpu_check']['physical']} on {r['host']} cannot run a GPU lane (ranks "
            f"{rank_span([f['rank'] for f in failed])}): {r['gpu_check']['problem']}. CuPy sees the "
            "GPU but not its CUDA libraries: load the CUDA module, or pip install "
            "'cupy-cuda12x[ctk]' (cupy-cuda13x[ctk] for CUDA 13).")
    warnings += lane_warnings(records)
    for r in records:
        if r.get("gpus") and r.get("cuda_aware") == "no":
            warnings.append(f"{r['host']} has {r['gpus']} GPU(s) but this MPI is not CUDA-aware: "
                            "gradients will be copied through host memory each step (slower).")
            break
    warnings += data_file_warnings(records, settings)
    warnings += _run_dir_warnings(records, shared, cwd_files)
    return warnings


def _host_warnings(host: str, recs: list[dict], settings: dict | None) -> list[str]:
    """One node's: oversubscribed or shared cores, BLAS threads, /dev/shm, Slurm's CPUs per task."""
    warnings = []
    n = len(recs)
    union = set().union(*(set(r["cores"]) for r in recs))
    cores = len(union)
    threads = [r["blas_threads"] for r in recs]
    if n > cores:
        warnings.append(
            f"{host}: {n} ranks share {cores} usable cores: every rank waits for a core at every "
            f"step (oversubscribed {n / cores:.1f}x). Start at most {cores} ranks on this node.")
    else:
        # Without an explicit setting training takes cores / ranks per node, which fits.
        warnings += thread_warnings(host, recs, cores, settings)
    if n > 1 and all(len(r["cores"]) == 1 for r in recs) and cores < n:
        warnings.append(f"{host}: ranks are pinned to the same core(s) {sorted(union)}: "
                        "check the launcher's binding options (--cpu-bind / -bind-to).")
    fit = shm_fit(recs)
    if n > 1 and fit is not None and fit[1] < SHM_WARN_BUCKET:
        warnings.append(
            f"{host}: {SHM_DIR} has {fit[0] / MIB:.0f} MiB free, so the sum in the node's shared "
            f"memory (comm.shared_memory) takes buckets of at most {fit[1] / MIB:.1f} MiB a rank "
            f"({fit[1] // 4 / 1e6:.1f} M float32 parameters) with {n} ranks here; larger models "
            "use MPI's Allreduce (slower). Give the job a larger /dev/shm (a container's "
            "--shm-size) or fewer ranks per node.")
    cpt = recs[0]["env"].get("SLURM_CPUS_PER_TASK")
    if cpt and cpt.isdigit() and max(threads) > int(cpt):
        warnings.append(f"{host}: Slurm gave each task {cpt} CPUs but BLAS runs {max(threads)} "
                        f"threads per rank: set OMP_NUM_THREADS={cpt}.")
    return warnings


def _run_dir_warnings(records: list[dict], shared: dict | None, cwd_files: dict | None) -> list[str]:
    """The run directory: writable on every rank, shared between nodes; slurm/train.sh's logs/."""
    warnings = []
    bad = [r for r in records if not r["run_dir"]["writable"]]
    if bad:
        r = bad[0]
        warnings.append(f"run directory {r['run_dir']['path']} cannot be written on ranks "
                        f"{rank_span([b['rank'] for b in bad])} ({r['run_dir']['checked']}: "
                        f"{r['run_dir']['why']}): the run will fail when it saves.")
    if shared and shared.get("missing"):
        warnings.append(
            f"the run directory is not shared: ranks {rank_span(shared['missing'])} do not see a file "
            f"rank 0 wrote in {shared['dir']}. Rank 0 writes checkpoints there; a requeued job whose "
            "rank 0 lands on another node would not find them. Use a shared filesystem "
            "(hydra.run.dir=/shared/path/...).")
    if cwd_files and cwd_files.get("train_sh") and not cwd_files.get("logs"):
        warnings.append("slurm/train.sh writes its log to logs/, which does not exist here: "
                        "Slurm would fail the job at launch without any log. Run: mkdir -p logs")
    return warnings


def _shm_line(host: str, recs: list[dict]) -> str:
    fit = shm_fit(recs)
    if fit is None:
        return f"  {SHM_DIR:<13} {host}: not measured"
    return (f"  {SHM_DIR:<13} {host}: {fit[0] / MIB:,.0f} MiB free: comm.shared_memory sums buckets "
            f"up to {fit[1] / MIB:,.0f} MiB a rank with {len(recs)} rank(s) here")


def launcher(env: dict, size: int) -> str:
    """How the ranks were started, from the variables launchers set."""
    step_tasks = env.get("SLURM_STEP_NUM_TASKS")
    if "SLURM_STEP_ID" in env and step_tasks == str(size):
        return f"srun (job {env.get('SLURM_JOB_ID')}, step {env['SLURM_STEP_ID']}, " \
               f"--mpi={env.get('SLURM_MPI_TYPE', 'site default')})"
    if "OMPI_COMM_WORLD_SIZE" in env:
        if "PRTE_LAUNCHED" in env:
            return "Open MPI mpirun (prterun)"
        return "Open MPI mpirun (orterun)" if "OMPI_MCA_orte_launch" in env else "Open MPI mpirun"
    if "HYDI_CONTROL_FD" in env:
        return "MPICH mpirun / mpiexec (hydra)"
    if "PMI_SIZE" in env or "PMIX_RANK" in env or "PMI_RANK" in env:
        return "mpirun / mpiexec"
    return "none (a single process)" if size == 1 else "unknown"


def _bucket_path(rec: dict) -> str:
    """How a run with GPU lanes (comm.cuda_aware=auto) would reduce its bucket on this rank."""
    return doctor_summary(rec.get("gpus"), str(rec.get("cuda_aware", "unknown")), str(rec.get("cuda_aware_how", "")))


def _gpu_check_note(records: list[dict]) -> str:
    checked = [r for r in records if isinstance(r.get("gpu_check"), dict)]
    if not checked:
        return ""
    bad = [r for r in checked if r["gpu_check"]["problem"]]
    if not bad:
        return f"; kernel, GEMM and pinned copy ok on the GPU of each of {len(checked)} rank(s)"
    return f"; {len(bad)} of {len(checked)} rank(s) cannot run on their GPU (see the warnings)"


def lane_warnings(records: list[dict]) -> list[str]:
    """Ranks whose lanes cannot start under the run's device settings, one line per reason."""
    by_problem = defaultdict(list)
    for r in records:
        if r.get("lanes_problem"):
            by_problem[r["lanes_problem"]].append(r)
    return [f"the run would stop at start-up on ranks {rank_span([r['rank'] for r in recs])} "
            f"({', '.join(sorted({r['host'] for r in recs}))}): {problem}"
            for problem, recs in sorted(by_problem.items())]


def data_file_warnings(records: list[dict], settings: dict | None) -> list[str]:
    """The training data must open on every rank that reads it: all of them with
    data.distribution=read, rank 0 alone with scatter."""
    scatter = (settings or {}).get("data_distribution") == "scatter"
    readers = [r for r in records if not scatter or r["rank"] == 0]
    by_problem = defaultdict(list)
    for r in readers:
        for path, problem in (r.get("data_files") or {}).items():
            if problem:
                by_problem[(path, problem)].append(r)
    out = []
    for (path, problem), recs in sorted(by_problem.items()):
        where = "" if len(recs) == len(readers) else \
            f" on ranks {rank_span([r['rank'] for r in recs])} ({', '.join(sorted({r['host'] for r in recs}))})"
        fix = ("" if scatter or len(recs) == len(readers) else
               "; put it on storage every node sees, or data.distribution=scatter (rank 0 reads and sends)")
        out.append(f"data file {path} {problem}{where}: the run would stop at data loading{fix}.")
    return out


def format_report(records: list[dict], warnings: list[str], *, shared: dict | None = None,
                  settings: dict | None = None) -> str:
    r0 = records[0]
    hosts = by_host(records)
    lines = [f"hpc_rlx doctor: {r0['size']} rank(s) on {len(hosts)} node(s)", ""]
    lines += ["MPI",
              f"  library       {r0.get('mpi_library', 'unknown')} (MPI {r0.get('mpi_standard', '?')}, "
              f"mpi4py {r0.get('mpi4py', '?')})",
              f"  world size    {r0['size']}",
              f"  launched by   {launcher(r0['env'], r0['size'])}",
              f"  thread level  {r0.get('thread_level', '?')}",
              f"  CUDA-aware    {r0.get('cuda_aware', 'unknown')} ({r0.get('cuda_aware_how', '')})",
              f"  GPU bucket    {_bucket_path(r0)}",
              ""]
    lines.append("Nodes")
    lines.append(f"  {'host':<16} {'ranks':<10} {'per node':>8} {'cores':>6} {'train thr/rank':>14} "
                 f"{'ranks x thr':>11} {'GPUs':>5}")
    for host, recs in sorted(hosts.items()):
        union = set().union(*(set(r["cores"]) for r in recs))
        threads = host_train_threads(recs, settings)
        thr = str(threads[0]) if len(set(threads)) == 1 else f"{min(threads)}-{max(threads)}"
        gpus = recs[0].get("gpus")
        lines.append(f"  {host:<16} {rank_span([r['rank'] for r in recs]):<10} {len(recs):>8} "
                     f"{len(union):>6} {thr:>14} {sum(threads):>11} {'?' if gpus is None else gpus:>5}")
    blas = ", ".join(f"{p['api']} {p['version']} ({p['layer']})" for p in r0.get("blas", [])) or "none found"
    env = ", ".join(f"{k}={r0['env'][k]}" for k in THREAD_ENV if k in r0["env"]) or "none set"
    lines += [f"  cores = usable by the ranks (CPU affinity); this node has {r0['cpu_count']} CPUs",
              f"  train thr     the BLAS threads each rank trains with ({settings_note(settings)})",
              f"  BLAS          {blas}; {r0['blas_threads']} thread(s) in this process before training's "
              f"limit; thread variables: {env}",
              f"  GPUs          {r0.get('gpus_how', '')}{_gpu_check_note(records)}"]
    lines += [_shm_line(host, recs) for host, recs in sorted(hosts.items())] + [""]
    lines += ["Software",
              f"  Python {r0.get('python', '?')} ({r0.get('executable', '?')})",
              f"  NumPy {r0.get('numpy', '?')}, h5py {r0.get('h5py', '?')}, HDF5 {r0.get('hdf5', '?')} "
              f"(parallel HDF5: {'yes' if r0.get('h5py_mpi') else 'no'}), hydra-core {r0.get('hydra', '?')}, "
              f"hpc_rlx {r0.get('hpc_rlx', '?')}", ""]
    rd = r0["run_dir"]
    state = "exists" if rd["exists"] else f"does not exist yet (checked {rd['checked']})"
    ok = all(r["run_dir"]["writable"] for r in records)
    lines += ["Run directory",
              f"  {rd['path']}: {state}; writable on every rank: {'yes' if ok else 'NO'}"]
    if shared is not None and len(records) > 1:
        lines.append(f"  shared by all ranks: {'yes' if not shared.get('missing') else 'NO'}"
                     f"{'' if shared.get('checked') else ' (not checked)'}")
    lines.append("")
    env0 = r0["env"]
    if "SLURM_JOB_ID" in env0:
        lines += ["Slurm",
                  f"  job {env0['SLURM_JOB_ID']}, step {env0.get('SLURM_STEP_ID', '(batch)')}, "
                  f"{env0.get('SLURM_NTASKS', '?')} tasks, {env0.get('SLURM_CPUS_PER_TASK', '?')} CPUs per "
                  f"task, nodes {env0.get('SLURM_JOB_NODELIST', '?')}", ""]
    if warnings:
        lines.append(f"Warnings ({len(warnings)})")
        lines += [f"  ! {w}" for w in warnings]
    else:
        lines.append("No problems found.")
    return "\n".join(lines) + "\n"


# ==================================================================================================
# Collective part
# ==================================================================================================

def _check_shared(comm, base: Path) -> dict:
    """Rank 0 writes a probe file; which ranks can see it?"""
    name = None
    if comm.rank == 0:
        probe = base / f".hpc_rlx_doctor_{uuid.uuid4().hex[:12]}"
        try:
            probe.write_text(socket.gethostname())
            name = str(probe)
        except OSError:
            name = None
    name = comm.bcast(name, root=0)
    if name is None:
        return {"checked": False, "missing": [], "dir": str(base)}
    seen = False
    deadline = time.monotonic() + 3.0
    while True:
        try:
            # listing the directory revalidates NFS's cached view of it
            seen = os.path.basename(name) in os.listdir(os.path.dirname(name))
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    flags = comm.gather(seen, root=0)
    comm.Barrier()
    if comm.rank == 0:
        try:
            os.unlink(name)
        except OSError:
            pass
        return {"checked": True, "missing": [r for r, s in enumerate(flags) if not s], "dir": str(base)}
    return {}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hpc_rlx.doctor",
                                 description="Preflight check of the MPI/BLAS/GPU/storage environment.")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="training config overrides, as given to python -m hpc_rlx "
                         "(e.g. train.threads_per_rank=4 device.cpu_lanes=2)")
    ap.add_argument("--run-dir", default=None,
                    help="where runs will write (default: hydra.run.dir= if given, else outputs, "
                         "as python -m hpc_rlx does)")
    ap.add_argument("--json", action="store_true", help="print the facts and warnings as JSON")
    ap.add_argument("--strict", action="store_true", help="exit with status 1 when there are warnings")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides, override_dir = split_run_dir(args.overrides)
    run_dir = Path(args.run_dir or override_dir or "outputs")
    before_mpi_starts()     # a fault-tolerant launch's settings (slurm/train.sh HPC_RLX_MODULE=...)
    try:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    except Exception as exc:  # noqa: BLE001 - report instead of a traceback
        print(f"hpc_rlx doctor: mpi4py cannot start MPI: {type(exc).__name__}: {exc}\n"
              "Install mpi4py against your MPI (or pip install hpc_rlx[mpich]).", file=sys.stderr)
        return 1
    settings = None
    if comm.rank == 0:
        try:
            settings = training_settings(overrides)
        except Exception as exc:  # noqa: BLE001 - a bad override is one message, then exit 2
            settings = {"error": str(exc)}
    settings = comm.bcast(settings, root=0)
    if "error" in settings:
        if comm.rank == 0:
            print(f"hpc_rlx doctor: error (ConfigError): {settings['error']}", file=sys.stderr)
        return 2
    rec = collect_local(comm.rank, comm.size, run_dir)
    rec["data_files"] = {p: safe_call(lambda p=p: data_file_problem(p), "could not be checked")
                         for p in settings.get("data_files", [])}
    rec.update(safe_call(lambda: mpi_facts(comm), {}))
    layout = safe_call(lambda: node_layout(comm), (0, 1))
    local, rec["ranks_on_node"] = layout if isinstance(layout, tuple) else (0, None)
    rec["gpu_check"] = safe_call(lambda: gpu_check(local), None)
    rec["lanes_problem"] = safe_call(lambda: lane_problem(settings, local), "")
    records = comm.gather(rec, root=0)
    shared = _check_shared(comm, nearest_existing(run_dir)) if comm.size > 1 else None
    if comm.rank != 0:
        return 0
    cwd_files = {"train_sh": Path("slurm/train.sh").is_file(), "logs": Path("logs").is_dir()}
    warnings = analyse(records, shared=shared, cwd_files=cwd_files, settings=settings)
    if args.json:
        for host, recs in by_host(records).items():
            for r, t in zip(recs, host_train_threads(recs, settings)):
                r["train_threads"] = t
        print(json.dumps({"ranks": records, "shared": shared, "warnings": warnings,
                          "settings": settings}, indent=1))
    else:
        print(format_report(records, warnings, shared=shared, settings=settings), end="")
    sys.stdout.flush()
    stopping = lane_warnings(records)
    if stopping:
        # what training would stop on at start-up is an error, not advice: one line, exit 2
        print(f"hpc_rlx doctor: error (DeviceError): {stopping[0]}", file=sys.stderr)
        return 2
    return 1 if (args.strict and warnings) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.exit(code)
