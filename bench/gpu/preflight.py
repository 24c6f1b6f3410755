"""What this GPU machine offers hpc_rlx: GPU, driver, CuPy, PyTorch, MPI and its CUDA-awareness.

    python bench/gpu/preflight.py [--out FILE]

Prints one line per fact and writes a Markdown header for bench/RESULTS.md to FILE. Exit 1
when CuPy cannot use a GPU or a module hpc_rlx needs is missing (each named, with the reason).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

NEEDED = ["numpy", "h5py", "mpi4py", "hydra", "omegaconf", "threadpoolctl", "sklearn", "cupy", "pytest",
          "pytest_timeout",
          "hypothesis"]
OPTIONAL = ["torch", "matplotlib"]


def version(name: str) -> str:
    try:
        mod = importlib.import_module(name)
        return str(getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        return f"MISSING ({type(exc).__name__}: {exc})"


def nvidia_smi() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "nvidia-smi not found"
    try:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
        head = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
        cuda = next((ln.split("CUDA Version:")[1].split("|")[0].strip() for ln in head.splitlines()
                     if "CUDA Version:" in ln), "?")
        return f"{q.replace(chr(10), '; ')} (driver CUDA {cuda})"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    facts = {"date": datetime.date.today().isoformat(), "host": platform.node(),
             "python": f"{platform.python_version()} ({sys.executable})", "nvidia-smi": nvidia_smi()}
    versions = {name: version(name) for name in NEEDED + OPTIONAL}
    missing = [n for n in NEEDED if versions[n].startswith("MISSING")]

    from hpc_rlx.base import backend
    gpu = "no"
    if backend.cupy_available():
        cp = backend.get_xp("cuda")
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gpu = (f"{backend.gpu_count()} GPU(s); GPU 0: {name}, compute capability {props['major']}.{props['minor']}, "
               f"{props['totalGlobalMem'] / 2**30:.0f} GiB; CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")
    else:
        gpu = f"none usable: {backend.gpu_unavailable_reason()}"
    facts["CuPy GPUs"] = gpu
    smoke = backend.smoke_test(0) if backend.cupy_available() else "not run"
    facts["CuPy kernels"] = smoke or "ok (elementwise, reduction, GEMM, pinned copy)"
    try:
        import torch
        facts["PyTorch CUDA"] = (f"{torch.__version__}, CUDA {torch.version.cuda}, "
                                 f"available: {torch.cuda.is_available()}")
    except Exception as exc:  # noqa: BLE001
        facts["PyTorch CUDA"] = f"unavailable ({type(exc).__name__})"
    try:
        from mpi4py import MPI

        from hpc_rlx.base.cuda_mpi import doctor_summary, query_cuda_support
        answer, how = query_cuda_support()
        facts["MPI"] = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
        facts["CUDA-aware MPI"] = f"{answer} ({how})"
        facts["bucket path (2 ranks, auto)"] = doctor_summary(backend.gpu_count(), answer, how)
    except Exception as exc:  # noqa: BLE001
        facts["MPI"] = f"unavailable ({type(exc).__name__}: {exc})"

    for k, v in facts.items():
        print(f"{k:>28}: {v}")
    print(f"{'modules':>28}: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
    if args.out:
        lines = [f"### GPU check, {facts['date']}", ""]
        lines += [f"- **{k}**: {v}" for k, v in facts.items() if k not in ("date",)]
        lines += ["- **modules**: " + ", ".join(f"{n} {v}" for n, v in versions.items()
                                                  if not v.startswith("MISSING")), ""]
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    problems = [f"missing module {n}: {versions[n]}" for n in missing]
    if not backend.cupy_available():
        problems.append(f"CuPy cannot use a GPU: {backend.gpu_unavailable_reason()}")
    elif smoke:
        problems.append(f"CuPy sees a GPU but cannot run on it: {smoke}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
