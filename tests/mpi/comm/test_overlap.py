"""`comm.overlap`: chunks of the fused bucket reduced while backward runs (`hpc_rlx.comm.overlap`).

Unit tests of the executor's `on_grad_ready` callback and of the chunk bookkeeping (a fake
communicator records what starts when), then real mpirun jobs: overlap on equals overlap off
in float64, the non-finite flag still skips / stops, checkpoints are the same, and the trace
shows the chunks' Allreduces starting inside the backward span."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from hpc_rlx.comm import overlap as overlap_mod
from hpc_rlx.comm.bucket_layout import STEP_FIELDS, BucketLayout
from hpc_rlx.comm.overlap import OverlapPlan, OverlapStep
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params

from tests.support.jobs import explain, read_metrics, train_job

R = np.random.default_rng(5)


# ---------------------------------------------------------------------------- the executor's callback

@pytest.mark.parametrize("model,kwargs,feeds", [
    ("mlp", dict(input_shape=(1, 8, 8), num_classes=10, hidden=[16, 12]),
     lambda: {"x": R.standard_normal((5, 1, 8, 8)), "y": R.integers(0, 10, 5)}),
    ("transformer_lm", dict(vocab_size=9, seq_len=4, d_model=8, n_heads=2, n_layers=1, d_ff=8,
                            tie_embeddings=True),     # a shared parameter: written twice
     lambda: {"x": R.integers(0, 9, (3, 4)), "y": R.integers(0, 9, (3, 4))}),
])
def test_each_gradient_is_reported_once_when_final(model, kwargs, feeds):
    g = build_model(model, **kwargs)
    layout = ParamLayout(g)
    params, grads = np.empty(layout.size), np.empty(layout.size)
    init_params(g, params, 0)
    pv, gv = layout.views(params), layout.views(grads)
    ex = Executor(g, np, "float64")
    batch = feeds()
    seen = {}
    grads[:] = np.nan
    ex.forward_backward(pv, gv, batch, seed=1, on_grad_ready=lambda n: seen.setdefault(n, []).append(gv[n].copy()))
    assert sorted(seen) == sorted(layout.names) and all(len(v) == 1 for v in seen.values())
    for name, (snap,) in seen.items():
        np.testing.assert_array_equal(snap, gv[name], err_msg=name)
    order = list(seen)
    trainable = [n for n in order if n not in layout.buffer_names]
    # backward finishes the last layer first: the first parameter is among the last reported
    assert trainable.index(layout.names[0]) >= len(trainable) - 2, order


# ---------------------------------------------------------------------------- the chunk bookkeeping

class _FakeReq:
    def __init__(self, log, lo, hi):
        self.log, self.span = log, (lo, hi)

    def Test(self):
        return True


class _FakeComm:
    def __init__(self, buf):
        self.buf, self.log = buf, []

    def Iallreduce(self, _in_place, part, op=None):
        lo = part.__array_interface__["data"][0] - self.buf.__array_interface__["data"][0]
        lo //= self.buf.itemsize
        self.log.append((lo, lo + part.shape[0]))
        return _FakeReq(self.log, lo, lo + part.shape[0])


def _fake_mpi():
    return SimpleNamespace(IN_PLACE=None, SUM=None, Request=SimpleNamespace(Waitall=lambda reqs: None))


@pytest.mark.parametrize("chunk", [1, 3, 7, 40, 1000])
def test_chunks_start_from_the_end_in_order_and_only_when_final(monkeypatch, chunk):
    monkeypatch.setattr(overlap_mod, "_mpi", _fake_mpi)
    spans = {"a": (0, 10), "b": (10, 13), "c": (13, 30), "buf": (30, 32)}
    layout = BucketLayout(32, STEP_FIELDS, tail_first=True)
    plan = OverlapPlan(layout, spans, chunk)
    buf = np.zeros(layout.size)
    comm = _FakeComm(buf)
    st = OverlapStep(plan, buf, comm, lambda a: bool(np.isfinite(a).all()))
    final = set()
    for name in ["buf", "c", "b", "a"]:           # the order backward reports them
        st.ready(name)
        final.update(range(layout.payload_start + spans[name][0], layout.payload_start + spans[name][1]))
        for lo, hi in comm.log:                    # nothing started before all of it was final
            assert set(range(max(lo, layout.payload_start), hi)) <= final
            assert lo > layout.payload_start       # the tail's and payload[0]'s chunk waits
    started_early = len(comm.log)
    buf[layout.payload_start] = np.nan             # debug.nan_rank writes here after backward
    assert not st.payload_finite()
    assert st.finish(seq=0) == plan.n
    his = [hi for _, hi in comm.log]
    assert his == sorted(his, reverse=True) and comm.log[0][1] == layout.size and comm.log[-1][0] == 0
    assert sum(hi - lo for lo, hi in comm.log) == layout.size            # every element once
    assert chunk >= 40 or started_early > 0


def test_a_non_finite_chunk_started_early_still_raises_the_flag(monkeypatch):
    monkeypatch.setattr(overlap_mod, "_mpi", _fake_mpi)
    layout = BucketLayout(20, STEP_FIELDS, tail_first=True)
    plan = OverlapPlan(layout, {"a": (0, 10), "b": (10, 20)}, 5)
    buf = np.zeros(layout.size)
    buf[-1] = np.inf
    st = OverlapStep(plan, buf, _FakeComm(buf), lambda a: bool(np.isfinite(a).all()))
    st.ready("b")
    buf[-1] = 0.0          # MPI owns the chunk now; its check was made when it started
    assert not st.payload_finite()


# ---------------------------------------------------------------------------- real jobs

EQUIV = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
         "model.hidden=[32,16]", "optim.lr=0.05", "checkpoint=off"]
TINY = "comm.overlap_chunk_mb=0.0001"     # 13 float64 values: smaller than any weight matrix


def _params(run: Path) -> dict:
    with h5py.File(run / "model.h5", "r") as f:
        return {k: f[k][...] for k in f.keys()}


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1e-300)) for k in a)


def _job(n, run, overrides, timeout=120):
    proc = train_job(n, run, overrides, timeout=timeout)
    assert proc.returncode == 0, explain(proc)
    return proc


def _spans(run: Path, name: str, pid: int) -> list[dict]:
    events = json.loads((run / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("name") == name and e.get("pid") == pid and e.get("ph") == "X"]


@pytest.mark.mpi
def test_overlap_equals_blocking_and_starts_inside_backward(tmp_path, digits_h5):
    base = EQUIV + [f"data.path={digits_h5}"]
    _job(2, tmp_path / "off", base)
    _job(2, tmp_path / "on", base + ["comm.overlap=true", TINY, "trace.enabled=true"])
    diff = _max_rel(_params(tmp_path / "off"), _params(tmp_path / "on"))
    assert diff <= 1e-10, diff
    for pid in (0, 1):
        backward = _spans(tmp_path / "on", "forward_backward", pid)
        chunks = [c for c in _spans(tmp_path / "on", "chunk", pid) if c["args"].get("overlap")]
        reduces = _spans(tmp_path / "on", "allreduce", pid)
        assert backward and chunks and reduces
        inside = [c for c in chunks if any(b["ts"] < c["ts"] < b["ts"] + b["dur"] for b in backward)]
        assert len(inside) > len(chunks) // 2, (len(inside), len(chunks))
        assert sum(any(b["ts"] < r["ts"] < b["ts"] + b["dur"] for b in backward) for r in reduces) \
            >= len(reduces) - 1


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("n,extra", [
    (2, ["comm.overlap_chunk_mb=0.004"]),          # 524 values: several parameters per chunk, W1 split
    (2, ["comm.overlap_chunk_mb=64"]),             # larger than the bucket: one chunk, at the end
    (3, [TINY]),
    (3, ["comm.overlap_chunk_mb=0.004", "data.distribution=scatter"]),
    (2, [TINY, "device.cpu_lanes=2"]),             # several lanes: the blocking path, same result
])
def test_overlap_equals_blocking_more_sizes_and_ranks(tmp_path, digits_h5, n, extra):
    base = EQUIV + [f"data.path={digits_h5}"]
    _job(n, tmp_path / "off", base + [e for e in extra if not e.startswith("comm.")])
    _job(n, tmp_path / "on", base + ["comm.overlap=true"] + extra)
    diff = _max_rel(_params(tmp_path / "off"), _params(tmp_path / "on"))
    assert diff <= 1e-10, diff


@pytest.mark.mpi
def test_non_finite_gradient_is_still_skipped(tmp_path, digits_h5):
    base = EQUIV + [f"data.path={digits_h5}", "train.on_nonfinite=skip", "debug.nan_rank=1", "debug.nan_step=4"]
    _job(2, tmp_path / "off", base)
    _job(2, tmp_path / "on", base + ["comm.overlap=true", TINY])
    assert [m["skipped_steps"] for m in read_metrics(tmp_path / "on")] == \
        [m["skipped_steps"] for m in read_metrics(tmp_path / "off")] == [1, 1]
    assert _max_rel(_params(tmp_path / "off"), _params(tmp_path / "on")) <= 1e-10


@pytest.mark.mpi
@pytest.mark.slow
def test_non_finite_gradient_still_stops(tmp_path, digits_h5):
    proc = train_job(2, tmp_path / "run", EQUIV + [f"data.path={digits_h5}", "train.on_nonfinite=stop",
                                                   "debug.nan_rank=0", "debug.nan_step=5", "comm.overlap=true",
                                                   TINY], timeout=120)
    assert proc.returncode == 2, explain(proc)
    assert "non-finite loss or gradient at step 5" in proc.stderr, explain(proc)


@pytest.mark.mpi
@pytest.mark.slow
def test_checkpoints_are_the_same_and_resume_across_the_switch(tmp_path, digits_h5):
    from hpc_rlx.checkpoint import read_checkpoint

    base = EQUIV[:-1] + [f"data.path={digits_h5}", "checkpoint.every_epochs=1"]
    _job(2, tmp_path / "off", base)
    _job(2, tmp_path / "on", base + ["comm.overlap=true", TINY])
    a = sorted((tmp_path / "off" / "checkpoints").glob("ckpt-*.h5"))
    b = sorted((tmp_path / "on" / "checkpoints").glob("ckpt-*.h5"))
    assert [p.name for p in a] == [p.name for p in b] and a
    for pa, pb in zip(a, b):
        sa, sb = read_checkpoint(pa), read_checkpoint(pb)
        assert sa.arrays.keys() == sb.arrays.keys()
        assert _max_rel(sa.arrays, sb.arrays) <= 1e-10
    # one epoch without overlap, the second resumed with it: the straight run's result
    run = tmp_path / "switch"
    _job(2, run, base + ["train.max_steps=" + str(int(a[0].stem.split("-")[1]))])
    proc = _job(2, run, base + ["comm.overlap=true", TINY])
    assert "resumed from" in proc.stdout, explain(proc)
    assert _max_rel(_params(tmp_path / "off"), _params(run)) <= 1e-10
