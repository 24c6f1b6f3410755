"""Dataset preparation: contents, determinism, atomic writes, ensure_prepared and the CLI."""

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc_rlx.data import prepare as prep
from hpc_rlx.data.__main__ import main as cli_main
from hpc_rlx.data.hdf5 import describe
from hpc_rlx.data.prepare import ensure_prepared, prepare
from hpc_rlx.base.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _load(path):
    with h5py.File(path, "r") as f:
        assert f["x"].chunks is None and f["y"].chunks is None  # contiguous: cheap row ranges
        return f["x"][()], f["y"][()], dict(f.attrs)


def test_digits(tmp_path):
    from sklearn.datasets import load_digits

    p = prepare("digits", tmp_path / "d.h5")
    x, y, attrs = _load(p)
    d = load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert x.min() == 0.0 and x.max() == 1.0
    assert attrs["num_classes"] == 10 and "load_digits" in attrs["source"]
    # same samples as scikit-learn's, pairs intact, only reordered
    ref = np.concatenate([d.data / 16.0, d.target[:, None]], axis=1)
    ours = np.concatenate([x.reshape(-1, 64).astype(np.float64), y[:, None]], axis=1)
    np.testing.assert_allclose(ours[np.lexsort(ours.T[::-1])], ref[np.lexsort(ref.T[::-1])], atol=1e-7)
    assert not np.array_equal(y, d.target)
    # any contiguous slice, e.g. a 10 % tail validation split, holds every class about equally
    for tail in (y[-180:], y[:300], y[900:1100]):
        counts = np.bincount(tail, minlength=10)
        assert counts.min() >= len(tail) / 10 - 3 and counts.max() <= len(tail) / 10 + 3, counts
    # fixed seed: the same file twice; another seed: another order
    x2, y2, _ = _load(prepare("digits", tmp_path / "d2.h5"))
    np.testing.assert_array_equal(y, y2)
    np.testing.assert_array_equal(x, x2)
    _, y3, _ = _load(prepare("digits", tmp_path / "d3.h5", seed=1))
    assert not np.array_equal(y, y3)


def test_synthetic_shapes_determinism_and_balance(tmp_path):
    p = prepare("synthetic", tmp_path / "s.h5", samples=3000, features=12, classes=5, seed=3)
    x, y, attrs = _load(p)
    assert x.shape == (3000, 12) and x.dtype == np.float32
    assert y.shape == (3000,) and y.dtype == np.int64
    assert attrs["num_classes"] == 5 and attrs["features"] == 12 and attrs["seed"] == 3
    assert np.bincount(y, minlength=5).min() > 500
    x2, y2, _ = _load(prepare("synthetic", tmp_path / "s2.h5", samples=3000, features=12, classes=5, seed=3))
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    _, y4, _ = _load(prepare("synthetic", tmp_path / "s4.h5", samples=3000, features=12, classes=5, seed=4))
    assert not np.array_equal(y, y4)


def test_synthetic_is_learnable(tmp_path):
    from sklearn.linear_model import LogisticRegression

    x, y, _ = _load(prepare("synthetic", tmp_path / "s.h5", samples=4000, features=16, classes=10))
    clf = LogisticRegression(max_iter=300).fit(x[:3000], y[:3000])
    assert clf.score(x[3000:], y[3000:]) > 0.6  # chance is 0.1
    assert clf.score(x[3000:], y[3000:]) < 1.0  # and not trivially separable


def test_synthetic_writes_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "_BLOCK_BYTES", 1 << 16)
    samples, features = 100_000, 16  # 6.4 MB of inputs
    tracemalloc.start()
    try:
        prepare("synthetic", tmp_path / "big.h5", samples=samples, features=features)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < samples * features * 4 // 8, f"peak {peak} bytes"
    info = describe(tmp_path / "big.h5")
    assert info.n == samples and info.x_shape == (features,)
    with h5py.File(tmp_path / "big.h5", "r") as f:
        tail = f["x"][-1000:]
    assert np.all(np.isfinite(tail)) and tail.std() > 0.5  # the last block was really written


def test_text(tmp_path):
    import pydoc_data.topics

    p = prepare("text", tmp_path / "t.h5", seq_len=16)
    x, y, attrs = _load(p)
    vocab = attrs["vocab"]
    assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == y.shape and x.shape[1] == 16
    assert attrs["vocab_size"] == len(vocab) == attrs["num_classes"]
    assert [chr(c) for c in attrs["vocab_codepoints"]] == list(vocab)
    assert 0 <= x.min() and max(x.max(), y.max()) < len(vocab)
    # y is x shifted by one token, across row boundaries too
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    np.testing.assert_array_equal(y[:-1, -1], x[1:, 0])
    text = "".join(vocab[i] for i in x[:20].reshape(-1))
    some_topic = next(iter(pydoc_data.topics.topics.values()))
    corpus = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    assert corpus.startswith(text) and len(corpus) // 16 - 1 <= len(x) <= len(corpus) // 16
    assert some_topic in corpus


@pytest.mark.parametrize(
    "kind,opts,pattern",
    [
        ("mnist", {}, r"unknown dataset kind 'mnist'; choose one of \['digits', 'synthetic', 'text'\]"),
        ("digits", {"samples": 5}, r"'digits' does not take option\(s\) \['samples'\]"),
        ("synthetic", {"samples": 0}, "samples must be an integer >= 1, got 0"),
        ("synthetic", {"classes": 1}, "classes must be an integer >= 2, got 1"),
        ("synthetic", {"separation": -1.0}, "separation must be a number > 0, got -1.0"),
        ("text", {"seq_len": 10**7}, "seq_len=10000000 is longer than the corpus"),
    ],
)
def test_prepare_rejects_bad_options(tmp_path, kind, opts, pattern):
    with pytest.raises(ConfigError, match=pattern):
        prepare(kind, tmp_path / "o.h5", **opts)
    assert os.listdir(tmp_path) == []  # nothing half-written


def test_failed_prepare_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    out = tmp_path / "s.h5"
    prepare("synthetic", out, samples=50, features=3)
    before = out.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("crash while writing")

    monkeypatch.setattr(prep, "_common_attrs", boom)
    with pytest.raises(RuntimeError, match="crash while writing"):
        prepare("synthetic", out, samples=80, features=3)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["s.h5"]
    with pytest.raises(RuntimeError):
        prepare("digits", tmp_path / "sub" / "new.h5")
    assert os.listdir(tmp_path / "sub") == []


def test_prepared_file_is_not_private(tmp_path):
    old = os.umask(0o022)
    try:
        p = prepare("synthetic", tmp_path / "s.h5", samples=10, features=2)
    finally:
        os.umask(old)
    assert os.stat(p).st_mode & 0o777 == 0o644


def test_ensure_prepared(tmp_path):
    p = tmp_path / "data" / "syn.h5"
    assert ensure_prepared(p, "synthetic", samples=40, features=4) == str(p)
    assert describe(p).n == 40
    mtime = os.stat(p).st_mtime_ns
    # present: left alone, even if the options differ
    assert ensure_prepared(p, "synthetic", samples=99, features=4) == str(p)
    assert os.stat(p).st_mtime_ns == mtime and describe(p).n == 40
    with pytest.raises(ConfigError, match="does not take"):
        ensure_prepared(p, "synthetic", sample=10)


def test_cli_in_process(tmp_path, capsys):
    out = tmp_path / "s.h5"
    assert cli_main(["prepare", "synthetic", "--out", str(out), "--samples", "64", "--features", "5",
                     "--classes", "4", "--seed", "9"]) == 0
    assert "64 rows" in capsys.readouterr().out
    info = describe(out)
    assert (info.n, info.x_shape, info.attrs["num_classes"], info.attrs["seed"]) == (64, (5,), 4, 9)
    assert cli_main(["info", str(out)]) == 0
    assert "rows: 64" in capsys.readouterr().out
    assert cli_main(["prepare", "digits", "--out", str(tmp_path / "d.h5"), "--seq-len", "8"]) == 1
    assert "does not take option(s) ['seq_len']" in capsys.readouterr().err
    assert cli_main(["info", str(tmp_path / "missing.h5")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_cli_module_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "t.h5"
    proc = subprocess.run(
        [sys.executable, "-m", "hpc_rlx.data", "prepare", "text", "--out", str(out), "--seq-len", "32"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert describe(out).x_shape == (32,)
