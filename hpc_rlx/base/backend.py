"""Array-module selection: NumPy on the host, CuPy on an NVIDIA GPU.

CuPy is imported here and nowhere else, lazily and guarded, so a NumPy-only machine never
needs it. Everything else receives the module (``xp``) explicitly and never converts arrays
between host and device behind the caller's back: ``to_numpy`` is the one explicit way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

import numpy as np

from hpc_rlx.base.errors import DeviceError

_lock = threading.Lock()
_probed = False
_cupy = None
_cupy_problem = "CuPy was not probed yet"
_gpus = 0


def _probe() -> None:
    """Import CuPy once and count the GPUs it sees; remember why it failed otherwise."""
    global _probed, _cupy, _cupy_problem, _gpus
    with _lock:
        if _probed:
            return
        try:
            import cupy  # the only CuPy import in hpc_rlx

            n = int(cupy.cuda.runtime.getDeviceCount())
            if n < 1:
                _cupy_problem = "CuPy is installed but sees no CUDA device"
            else:
                _cupy, _gpus, _cupy_problem = cupy, n, ""
        except ImportError as exc:
            _cupy_problem = f"CuPy is not installed ({exc}); install hpc_rlx[cuda12] or [cuda13]"
        except Exception as exc:  # driver/runtime missing or broken: report, don't crash
            _cupy_problem = f"CuPy cannot reach a CUDA device: {type(exc).__name__}: {exc}"
        _probed = True


def cupy_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible."""
    _probe()
    return _cupy is not None


def gpu_count() -> int:
    """Number of CUDA devices CuPy can use on this process (0 without CuPy)."""
    _probe()
    return _gpus


def gpu_unavailable_reason() -> str:
    """Why ``cupy_available()`` is False ("" when a GPU is usable)."""
    _probe()
    return _cupy_problem


def get_xp(kind: str, device: int | None = None):
    """The array module for ``kind``: ``"cpu"`` -> numpy, ``"cuda"`` (or ``"gpu"``) -> cupy.

    ``device`` (cuda only) is checked against the visible GPUs; select it for a block of work
    with ``use_device``.
    """
    if not isinstance(kind, str):
        raise DeviceError(f"device must be a string such as 'cpu' or 'cuda', got {kind!r}")
    name = kind.strip().lower()
    if name in ("cpu", "numpy", "host"):
        return np
    if name in ("cuda", "gpu", "cupy"):
        _probe()
        if _cupy is None:
            raise DeviceError(f"device {kind!r} requested but unavailable: {_cupy_problem}")
        if device is not None and not (isinstance(device, int) and 0 <= device < _gpus):
            raise DeviceError(f"GPU index {device!r} is out of range: this process sees {_gpus} GPU(s)")
        return _cupy
    raise DeviceError(f"unknown device {kind!r}; use 'cpu' or 'cuda'")


def use_device(index: int | None):
    """Context manager making GPU ``index`` current for this thread (no-op for None / CPU).

    On exit it switches back to the thread's previous device: only use it in a thread that
    already selected its own GPU (``select_device``), see there why."""
    if index is None or _cupy is None:
        return contextlib.nullcontext()
    return _cupy.cuda.Device(index)


def select_device(index: int | None) -> None:
    """Make GPU ``index`` this thread's current device and leave it so (no-op for None).

    A thread that works for one GPU (a rank's main thread, a lane's worker) selects it before
    any other CUDA call. Otherwise its current device is GPU 0, where the first allocation
    (pinned memory too) creates a CUDA context, and so does leaving any ``use_device`` block,
    since switching back to a device creates its context from CUDA 12 on. A rank that drives
    GPU 1 would then also hold a context on GPU 0: memory taken from the rank that owns GPU 0,
    and a failed start where GPUs run in exclusive-process mode. CUDA-aware MPI also wants the
    buffer's GPU current when it is called.
    """
    if index is None:
        return
    get_xp("cuda", device=index)      # a clear error for a GPU this process does not see
    _cupy.cuda.Device(index).use()


def smoke_test(index: int = 0) -> str:
    """Run on GPU ``index`` what a GPU lane needs: a JIT-compiled elementwise kernel and a
    reduction (NVRTC), a GEMM (cuBLAS) and a pinned round trip. "" when all of it works, else
    why not in one line. CuPy counts GPUs even when those CUDA libraries are missing (a node
    with only the driver and no CUDA Toolkit), so a GPU count alone does not say a lane can run.
    Makes ``index`` this thread's current device (see ``select_device``)."""
    try:
        select_device(index)
        cp = _cupy
        a = cp.arange(256, dtype=cp.float32)
        m = cp.ones((64, 64), cp.float32)
        if float((a * 2).sum()) != 65280.0 or float((m @ m)[0, 0]) != 64.0:
            return "wrong results from a kernel or a GEMM"
        host = pinned_empty(256, np.float32)
        copy_to_host(host, a)
        if not (is_pinned(host) and host[255] == 255.0):
            return "the pinned device-to-host copy failed"
        return ""
    except Exception as exc:  # noqa: BLE001 - a diagnosis, not a crash
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _loaded_cupy():
    # An array can only be a CuPy array if CuPy was imported by someone already.
    return _cupy if _cupy is not None else sys.modules.get("cupy")


def is_device_array(arr) -> bool:
    cp = _loaded_cupy()
    return cp is not None and isinstance(arr, cp.ndarray)


def array_module(arr):
    """numpy or cupy, whichever owns ``arr`` (numpy for host arrays and Python scalars)."""
    if is_device_array(arr):
        return _loaded_cupy()
    return np


def to_numpy(arr) -> np.ndarray:
    """An explicit device-to-host copy for CuPy arrays; NumPy arrays are returned as they are."""
    if is_device_array(arr):
        return arr.get()
    return np.asarray(arr)


def synchronize(xp) -> None:
    """Wait for queued device work (needed before handing a GPU buffer to MPI); no-op on NumPy."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


# --------------------------------------------------------------------------------------
# Explicit transfers. Lanes and the bucket move data only through these, so every copy
# between host and device (or between GPUs) is visible in one place.
# --------------------------------------------------------------------------------------

def visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES split into entries (None when unset): CuPy's GPU i is entry i."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [d.strip() for d in raw.split(",") if d.strip()]


def physical_gpu(index: int) -> str:
    """The node-level name of CuPy's GPU ``index``: its CUDA_VISIBLE_DEVICES entry, if any."""
    vis = visible_devices()
    if vis is not None and 0 <= index < len(vis):
        return vis[index]
    return str(index)


def device_of(arr) -> int | None:
    """The GPU a CuPy array lives on; None for host arrays."""
    return int(arr.device.id) if is_device_array(arr) else None


def pinned_empty(size: int, dtype) -> np.ndarray:
    """A 1-D host array in page-locked memory when a GPU is usable, so copies to and from the
    device are truly asynchronous and run at full PCIe/NVLink speed; plain memory otherwise.
    Allocate once and reuse: pinning is expensive and the amount of it is limited."""
    dt = np.dtype(dtype)
    _probe()
    if _cupy is None:
        return np.empty(int(size), dt)
    mem = _cupy.cuda.alloc_pinned_memory(max(1, int(size) * dt.itemsize))
    return np.ndarray((int(size),), dtype=dt, buffer=mem)


def is_pinned(arr: np.ndarray) -> bool:
    """True when ``arr``'s memory is page-locked (allocated by ``pinned_empty``)."""
    if _cupy is None or not isinstance(arr, np.ndarray):
        return False
    base = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, _cupy.cuda.PinnedMemoryPointer)


def device_zeros(size: int, dtype, device: int):
    """A zeroed 1-D array on GPU ``device``."""
    xp = get_xp("cuda", device=device)
    with use_device(device):
        return xp.zeros(int(size), dtype=dtype)


def copy_to_device(dst, src: np.ndarray) -> None:
    """``dst[...] = src`` from host to GPU, queued on dst's device's current stream (truly
    asynchronous when ``src`` is pinned; the caller must not modify ``src`` until the device
    has consumed it)."""
    src = np.ascontiguousarray(src, dtype=dst.dtype)
    if src.size != dst.size:
        raise ValueError(f"copy_to_device: {src.size} host elements into {dst.size} device elements")
    with use_device(device_of(dst)):
        dst.data.copy_from_host_async(src.ctypes.data, src.nbytes)


def copy_to_host(dst: np.ndarray, src, wait: bool = True) -> None:
    """``dst[...] = src`` from GPU to host on src's device's current stream. With ``wait``
    (the default) returns once the bytes are in ``dst``; otherwise call ``synchronize_device``."""
    if dst.dtype != src.dtype or dst.size != src.size or not dst.flags.c_contiguous:
        raise ValueError(f"copy_to_host: {src.size} x {src.dtype} device elements into "
                         f"{dst.size} x {dst.dtype} host elements (contiguous: {dst.flags.c_contiguous})")
    dev = device_of(src)
    with use_device(dev):
        src = _cupy.ascontiguousarray(src)
        src.data.copy_to_host_async(dst.ctypes.data, src.nbytes)
        if wait:
            _cupy.cuda.get_current_stream().synchronize()


def copy_between_devices(dst, src) -> None:
    """``dst[...] = src`` between GPUs (peer copy under unified addressing), queued on dst's
    device's current stream; the caller makes sure src is ready."""
    if dst.dtype != src.dtype or dst.size != src.size:
        raise ValueError(f"copy_between_devices: {src.size} x {src.dtype} into {dst.size} x {dst.dtype}")
    with use_device(device_of(dst)):
        dst.data.copy_from_device_async(src.data, src.nbytes)


def synchronize_device(index: int | None) -> None:
    """Wait for the work queued on GPU ``index``'s current stream (no-op for None)."""
    if index is None or _cupy is None:
        return
    with _cupy.cuda.Device(index):
        _cupy.cuda.get_current_stream().synchronize()


_host_tuned = None


def keep_host_memory() -> bool:
    """Ask glibc to keep freed host memory for reuse instead of returning it to the kernel.

    A training step frees and re-allocates the same multi-megabyte activations every step; by
    default glibc trims them off the heap (or unmaps them) and the next step pays page faults
    to get them back, which cost as much as the convolutions themselves here. This is the host
    analogue of CuPy's memory pool. Idempotent; False where it does not apply (not glibc).
    """
    global _host_tuned
    with _lock:
        if _host_tuned is None:
            _host_tuned = False
            if sys.platform.startswith("linux"):
                try:
                    libc = ctypes.CDLL(None)
                    m_trim_threshold, m_mmap_threshold = -1, -3
                    ok_mmap = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)  # glibc's ceiling
                    ok_trim = libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)
                    _host_tuned = bool(ok_mmap and ok_trim)
                except (OSError, AttributeError):
                    _host_tuned = False
        return _host_tuned


def is_host(xp) -> bool:
    """Whether ``xp`` computes on the host: NumPy, or NumPy with another BLAS's matrix
    products (`host_blas.HostArrays`, which sets ``host_module``)."""
    return xp is np or getattr(xp, "host_module", False) is True


def scatter_add(xp, target, indices, values) -> None:
    """``target[indices[k]] += values[k]`` with repeated indices accumulated (embedding VJP).

    ``indices`` is 1-D and indexes ``target``'s first axis; ``values`` has one row per index.
    """
    if len(indices) == 0:
        return
    if is_host(xp):
        # Sort once and sum runs of equal ids: several times faster than np.add.at on rows,
        # and the summation order is fixed, so results are reproducible.
        order = np.argsort(indices, kind="stable")
        ids = indices[order]
        starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
        target[ids[starts]] += np.add.reduceat(values[order], starts, axis=0)
    else:
        import cupyx  # ships with CuPy; only reached with a CuPy array in hand

        cupyx.scatter_add(target, indices, values)


def erf(xp, x):
    """The error function of ``x`` on ``xp``'s device (neither NumPy nor CuPy has one)."""
    if is_host(xp):
        try:
            from scipy.special import erf as host_erf  # optional: only graphs with erf need it
        except ImportError as exc:
            raise ImportError(f"the erf op (and gelu approximate='none') needs SciPy on the host: {exc}") from None
        return host_erf(x)
    from cupyx.scipy.special import erf as device_erf  # ships with CuPy; reached with a CuPy array

    return device_erf(x)


def derive_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from several integers (train seed, node, step ...)."""
    state = np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def uniform(xp, seed: int, shape, dtype):
    """Uniform [0, 1) samples of ``dtype`` generated directly on ``xp``'s device."""
    if is_host(xp):
        return np.random.default_rng(seed).random(shape, dtype=dtype)
    return xp.random.RandomState(seed % (2**63)).random_sample(shape, dtype=dtype)
