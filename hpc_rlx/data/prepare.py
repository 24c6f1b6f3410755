"""Writing the datasets hpc_rlx ships recipes for, as row-aligned HDF5 files.

Three kinds, all offline (nothing is downloaded):

- ``digits``: scikit-learn's bundled 8x8 hand-written digits, ``x`` float32 (N, 1, 8, 8) in
  [0, 1], ``y`` int64 (N,);
- ``synthetic``: Gaussian class clusters of any size, ``x`` float32 (N, F), ``y`` int64 (N,),
  generated and written block by block so memory stays small whatever N is;
- ``text``: a character-level corpus from CPython's bundled ``pydoc_data`` documentation,
  ``x``/``y`` int64 (N, T) with ``y`` the next character of ``x``.

Datasets use the contiguous HDF5 layout (no chunking, no compression): a row range is one
contiguous byte range on disk, the cheapest possible hyperslab read. Every file is written to a
temporary name in the target directory and renamed into place, so a crash never leaves a
half-written dataset behind.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import sys
import uuid
from typing import Any, Callable

import h5py
import numpy as np

from hpc_rlx.base.version import __version__
from hpc_rlx.base.errors import ConfigError, DataError

__all__ = [
    "X_NAME",
    "Y_NAME",
    "KINDS",
    "prepare",
    "prepare_digits",
    "prepare_synthetic",
    "prepare_text",
    "ensure_prepared",
    "atomic_h5",
]

X_NAME = "x"
Y_NAME = "y"

# rows of synthetic data generated per block: about 8 MiB of float32 inputs
_BLOCK_BYTES = 8 << 20


@contextlib.contextmanager
def atomic_h5(out):
    """Yield an h5py.File on a temporary sibling of ``out``; rename it to ``out`` on success."""
    out = os.path.abspath(os.fspath(out))
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.makedirs(parent, exist_ok=True)
        # os.open with 0o666 honours the umask, so the data is readable like any other file
        # (mkstemp would make it private to this user)
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError as e:
        raise DataError(f"cannot create dataset file {out!r}: {e}") from None
    try:
        with h5py.File(tmp, "w") as f:
            yield f
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out)
    except OSError as e:
        raise DataError(f"writing dataset file {out!r} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _common_attrs(f: h5py.File, kind: str, num_classes: int, source: str, seed) -> None:

    f.attrs["kind"] = kind
    f.attrs["num_classes"] = int(num_classes)
    f.attrs["source"] = source
    if seed is not None:
        f.attrs["seed"] = int(seed)
    f.attrs["x_name"] = X_NAME
    f.attrs["y_name"] = Y_NAME
    f.attrs["prepared_by"] = f"hpc_rlx {__version__}"


def _int_opt(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ConfigError(f"dataset option {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def _balanced_order(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A shuffle that spreads every class evenly along the array.

    Each sample gets the key (its random rank within its class + jitter) / class size; sorting
    by key interleaves classes in proportion, so any contiguous slice (a rank's shard, the tail
    validation split) holds about the global class mix.
    """
    keys = np.empty(len(y), dtype=np.float64)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        ranks = rng.permutation(len(idx))
        keys[idx] = (ranks + rng.random(len(idx))) / len(idx)
    return np.argsort(keys, kind="stable")


def prepare_digits(out, seed: int = 0) -> str:
    """scikit-learn's 1797 8x8 digits as ``x`` (N, 1, 8, 8) float32 in [0, 1] and ``y`` int64."""
    from sklearn.datasets import load_digits

    seed = _int_opt("seed", seed, 0)
    d = load_digits()
    x = (np.asarray(d.data, dtype=np.float64) / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = np.asarray(d.target, dtype=np.int64)
    order = _balanced_order(y, np.random.default_rng(seed))
    with atomic_h5(out) as f:
        f.create_dataset(X_NAME, data=x[order])
        f.create_dataset(Y_NAME, data=y[order])
        _common_attrs(
            f, "digits", 10,
            "scikit-learn load_digits (UCI optical recognition of handwritten digits, 8x8 "
            "pixels 0..16 scaled to [0, 1]); class-interleaved shuffle",
            seed,
        )
    return os.fspath(out)


def prepare_synthetic(
    out,
    samples: int = 10000,
    features: int = 32,
    classes: int = 10,
    seed: int = 0,
    separation: float = 4.0,
) -> str:
    """Gaussian clusters: ``y`` uniform over ``classes``, ``x = center[y] + N(0, I)``.

    Centers are random with an expected pairwise distance of ``separation`` noise standard
    deviations, so the classes are learnable but overlap a little. Output depends only on the
    options (blocks are seeded by their index), never on memory or timing.
    """
    samples = _int_opt("samples", samples, 1)
    features = _int_opt("features", features, 1)
    classes = _int_opt("classes", classes, 2)
    seed = _int_opt("seed", seed, 0)
    if not isinstance(separation, numbers.Real) or not (0.0 < float(separation) < math.inf):
        raise ConfigError(f"dataset option separation must be a number > 0, got {separation!r}")
    separation = float(separation)
    # E|c_i - c_j| ~ scale * sqrt(2F) for standard normal centers
    scale = separation / math.sqrt(2.0 * features)
    centers = (np.random.default_rng([seed, 0]).standard_normal((classes, features)) * scale).astype(np.float32)
    block = max(1, _BLOCK_BYTES // (4 * features))
    with atomic_h5(out) as f:
        dx = f.create_dataset(X_NAME, shape=(samples, features), dtype=np.float32)
        dy = f.create_dataset(Y_NAME, shape=(samples,), dtype=np.int64)
        for b, start in enumerate(range(0, samples, block)):
            rows = min(block, samples - start)
            rng = np.random.default_rng([seed, 1, b])
            y = rng.integers(0, classes, size=rows, dtype=np.int64)
            x = rng.standard_normal((rows, features), dtype=np.float32)
            x += centers[y]
            dx[start : start + rows] = x
            dy[start : start + rows] = y
        _common_attrs(
            f, "synthetic", classes,
            f"Gaussian clusters: {classes} random centers (mean pairwise distance {separation} "
            f"noise std) in {features} dimensions, unit noise",
            seed,
        )
        f.attrs["features"] = features
        f.attrs["separation"] = separation
    return os.fspath(out)


def _text_corpus() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def prepare_text(out, seq_len: int = 64) -> str:
    """Character-level LM windows over CPython's bundled documentation topics.

    Non-overlapping windows of ``seq_len`` characters: ``x[i] = ids[iT : iT+T]`` and
    ``y[i] = ids[iT+1 : iT+T+1]``. Rows keep corpus order, so a tail split is held-out text.
    """
    seq_len = _int_opt("seq_len", seq_len, 1)
    text = _text_corpus()
    vocab = "".join(sorted(set(text)))
    lut = {ch: i for i, ch in enumerate(vocab)}
    ids = np.fromiter((lut[ch] for ch in text), dtype=np.int64, count=len(text))
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ConfigError(f"dataset option seq_len={seq_len} is longer than the corpus ({len(ids)} characters)")
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    with atomic_h5(out) as f:
        f.create_dataset(X_NAME, data=x)
        f.create_dataset(Y_NAME, data=y)
        _common_attrs(
            f, "text", len(vocab),
            f"CPython {sys.version.split()[0]} pydoc_data.topics documentation text, "
            f"{len(text)} characters, character-level",
            None,
        )
        f.attrs["vocab_size"] = len(vocab)
        f.attrs["vocab"] = vocab
        # the same vocabulary as code points, for readers that mangle non-ASCII strings
        f.attrs["vocab_codepoints"] = np.array([ord(c) for c in vocab], dtype=np.int32)
        f.attrs["seq_len"] = seq_len
    return os.fspath(out)


_RECIPES: dict[str, tuple[Callable[..., str], tuple[str, ...]]] = {
    "digits": (prepare_digits, ("seed",)),
    "synthetic": (prepare_synthetic, ("samples", "features", "classes", "seed", "separation")),
    "text": (prepare_text, ("seq_len",)),
}
KINDS = tuple(_RECIPES)


def prepare(kind: str, out, **options: Any) -> str:
    """Write dataset ``kind`` to ``out`` (replacing it atomically); returns the path."""
    return _recipe(kind, options)(out, **options)


def _recipe(kind: str, options: dict) -> Callable[..., str]:
    if kind not in _RECIPES:
        raise ConfigError(f"unknown dataset kind {kind!r}; choose one of {list(KINDS)}")
    fn, allowed = _RECIPES[kind]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"dataset kind {kind!r} does not take option(s) {unknown}; it takes {list(allowed)}"
        )
    return fn


def ensure_prepared(path, kind: str, **options: Any) -> str:
    """Prepare ``kind`` at ``path`` unless a file is already there; returns the path.

    Call it on one rank (then barrier): concurrent callers are safe, since each writes its own
    temporary file and the renames are atomic, but the work would be repeated.
    """
    path = os.fspath(path)
    fn = _recipe(kind, options)  # a typo in the options fails even when the file exists
    if os.path.exists(path):
        return path
    return fn(path, **options)
