"""Array-module selection: NumPy always, CuPy only when importable and a GPU is visible."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from hpc_rlx.base import backend
from hpc_rlx.base.errors import DeviceError

PKG = pathlib.Path(__file__).resolve().parents[3] / "hpc_rlx"


def test_cpu_is_numpy():
    assert backend.get_xp("cpu") is np
    assert backend.get_xp("CPU") is np


def test_unknown_device_names_it():
    with pytest.raises(DeviceError, match="'tpu'"):
        backend.get_xp("tpu")
    with pytest.raises(DeviceError):
        backend.get_xp(0)


def test_cuda_matches_availability():
    assert isinstance(backend.cupy_available(), bool)
    assert backend.gpu_count() >= (1 if backend.cupy_available() else 0)
    if backend.cupy_available():
        assert backend.get_xp("cuda").__name__ == "cupy"
        assert backend.gpu_unavailable_reason() == ""
        with pytest.raises(DeviceError, match="out of range"):
            backend.get_xp("cuda", device=backend.gpu_count())
    else:
        assert backend.gpu_count() == 0
        assert backend.gpu_unavailable_reason()
        with pytest.raises(DeviceError, match="unavailable"):
            backend.get_xp("cuda")


def test_host_helpers():
    a = np.arange(6.0)
    assert backend.array_module(a) is np
    assert backend.array_module(3.0) is np
    assert backend.to_numpy(a) is a
    assert not backend.is_device_array(a)
    backend.synchronize(np)  # no-op on the host
    with backend.use_device(None):
        pass


def test_scatter_add_accumulates_repeats():
    t = np.zeros((4, 2))
    backend.scatter_add(np, t, np.array([1, 1, 3]), np.ones((3, 2)))
    assert t.tolist() == [[0, 0], [2, 2], [0, 0], [1, 1]]


def test_uniform_is_seeded_and_dtype_exact():
    a = backend.uniform(np, backend.derive_seed(5, 1), (3, 4), np.float32)
    b = backend.uniform(np, backend.derive_seed(5, 1), (3, 4), np.float32)
    c = backend.uniform(np, backend.derive_seed(5, 2), (3, 4), np.float32)
    assert a.dtype == np.float32 and np.array_equal(a, b) and not np.array_equal(a, c)
    assert 0.0 <= a.min() and a.max() < 1.0


def test_keep_host_memory_is_idempotent():
    first = backend.keep_host_memory()
    assert backend.keep_host_memory() == first


def test_cupy_imported_only_in_backend():
    """The one guarded import: no other module under hpc_rlx/ imports cupy."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "backend.py" and path.parent == PKG / "base":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] in ("cupy", "cupyx") for n in names):
                offenders.append(str(path.relative_to(PKG)))
    assert offenders == []


def test_graph_engine_imports_no_mpi_hdf5_hydra():
    banned = {"mpi4py", "h5py", "hydra", "omegaconf", "torch"}
    files = [PKG / "base" / "backend.py", *sorted((PKG / "graph").rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            else:
                continue
            assert not {m.split(".")[0] for m in mods} & banned, f"{path.name} imports {mods}"
