"""`wire_bytes`: the bytes the ranks sent, per epoch in metrics.jsonl (summed over ranks) and per
rank in summary.json, against the volume each reduction path moves for the model's known size.

MPI's own Allreduce is computed as a ring's volume (2 (N - 1) / N of the bucket per rank); the
16-bit wire and the sharded reduce-scatter count what they send. Exact integers, no timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpc_rlx.comm.bucket_layout import BucketLayout
from hpc_rlx.comm.codec import Codec
from hpc_rlx.base.even_split import segments
from hpc_rlx.graph import ParamLayout
from hpc_rlx.graph.ir import Graph
from hpc_rlx.policies.registry import POLICIES

from tests.support.jobs import REPO, explain, read_metrics, train_job, write_small_classification

RANKS = 2
ITEM = 4        # train.dtype=float32

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the tensorboard package reads the event files")


def _run(tmp_path, overrides: list[str], epochs: int = 2):
    data = write_small_classification(tmp_path / "d.h5", rows=400, seed=3)
    run_dir = tmp_path / "run"
    proc = train_job(RANKS, run_dir, ["data=file", f"data.path={data}", f"train.epochs={epochs}",
                                      "checkpoint=off", "comm.shared_memory=false", *overrides], timeout=180)
    assert proc.returncode == 0, explain(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, read_metrics(run_dir), summary


def _sizes(run_dir, policy: str) -> tuple[int, int]:
    """(payload values, tail values) of the run's bucket: the graph's parameters, the policy's slots."""
    payload = ParamLayout(Graph.from_file(run_dir / "graph.json")).size
    cls = POLICIES[policy]
    layout = BucketLayout(payload, cls.bucket_fields, cls.bucket_rank_fields, RANKS)
    return payload, layout.tail_size


def _ring(nbytes: int) -> int:
    return 2 * (RANKS - 1) * nbytes // RANKS


def _check_sums(epochs: list[dict], summary: dict) -> None:
    """metrics.jsonl's figure is the sum over ranks of each rank's, epoch by epoch and in all."""
    ranks = summary["ranks"]
    assert len(ranks) == RANKS
    for i, rec in enumerate(epochs):
        assert rec["wire_bytes"] == sum(r["epochs"][i]["wire_bytes"] for r in ranks), (rec, ranks)
    assert sum(rec["wire_bytes"] for rec in epochs) == sum(r["wire_bytes"] for r in ranks)


@pytest.mark.mpi
@pytest.mark.parametrize("policy, more", [
    ("sync", []), ("cadence", []), ("async", []),
    ("async", ["policy.outer=diloco"]),         # the outer step comes from the same sum
    ("sync", ["comm.overlap=true"]),            # chunks started during backward
    ("sync", ["comm.deterministic=true"]),      # Gather + Bcast, reported as the ring's total
])
def test_mpi_allreduce_reports_a_rings_volume_for_every_sync(tmp_path, policy, more):
    run_dir, epochs, summary = _run(tmp_path, [f"policy={policy}", *more])
    payload, tail = _sizes(run_dir, policy)
    per_sync = _ring((payload + tail) * ITEM)
    for i, rec in enumerate(epochs):
        syncs = rec["syncs"]
        assert syncs >= 1, rec
        for r in summary["ranks"]:
            assert r["epochs"][i]["wire_bytes"] == syncs * per_sync, (policy, rec, r["epochs"][i])
        assert rec["wire_bytes"] == RANKS * syncs * per_sync
    _check_sums(epochs, summary)


@pytest.mark.mpi
def test_the_16_bit_wire_counts_its_words_about_half_the_float32_volume(tmp_path):
    run_dir, epochs, summary = _run(tmp_path, ["comm.wire_dtype=bfloat16"], epochs=1)
    payload, tail = _sizes(run_dir, "sync")
    # one chunk: each owner's segment in the codec's words, the tail (float32 as 16-bit words)
    # behind owner 0's; a rank sends its words for the other owners, then its sum to the others
    words = [Codec.words(hi - lo) for lo, hi in segments(payload, RANKS)]
    words[0] += tail * ITEM // 2
    sent = [2 * (sum(words) - words[r]) + 2 * words[r] * (RANKS - 1) for r in range(RANKS)]
    steps = epochs[0]["steps"]
    for r in summary["ranks"]:
        assert r["wire_bytes"] == steps * sent[r["rank"]], (r["wire_bytes"], steps, sent)
    float32 = RANKS * steps * _ring((payload + tail) * ITEM)
    assert epochs[0]["wire_bytes"] == pytest.approx(float32 / 2, rel=0.02)
    _check_sums(epochs, summary)


@pytest.mark.mpi
@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_the_sharded_step_counts_its_reduce_scatter_and_computes_its_allgathers(tmp_path, wire):
    coded = [f"comm.wire_dtype={wire}"] if wire else []
    run_dir, epochs, summary = _run(tmp_path, ["comm.shard=optimizer", *coded], epochs=1)
    payload, tail = _sizes(run_dir, "sync")
    bounds = segments(payload, RANKS)
    longest = max(hi - lo for lo, hi in bounds)
    # the reduce-scatter (counted): every slice but its own, as values or as the codec's words
    slices = [2 * Codec.words(hi - lo) if wire else (hi - lo) * ITEM for lo, hi in bounds]
    steps = epochs[0]["steps"]
    for r in summary["ranks"]:
        per_step = ((RANKS - 1) * tail * ITEM           # the tail's Allgather (computed)
                    + sum(slices) - slices[r["rank"]]
                    + (RANKS - 1) * longest * ITEM)     # the parameters' Allgather of padded blocks (computed)
        assert r["wire_bytes"] == steps * per_step, (r["rank"], r["wire_bytes"], steps, per_step)
    _check_sums(epochs, summary)


@pytest.mark.mpi
def test_ranks_of_one_node_summing_in_shared_memory_send_nothing_and_tensorboard_and_report_show_it(tmp_path):
    data = write_small_classification(tmp_path / "d.h5", rows=400, seed=3)
    run_dir = tmp_path / "run"
    proc = train_job(RANKS, run_dir, ["data=file", f"data.path={data}", "train.epochs=1", "checkpoint=off",
                                      "report.tensorboard=true"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    epochs = read_metrics(run_dir)
    assert [rec["wire_bytes"] for rec in epochs] == [0], epochs      # one node: nothing crossed it
    board = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    board.Reload()
    assert [e.value for e in board.Scalars("epoch/wire_bytes")] == [0.0]
    report = subprocess.run([sys.executable, "-m", "hpc_rlx.report", str(run_dir), "--no-plots"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, explain(report)
    assert "bytes on the wire: 0.00 MiB over the run" in report.stdout, report.stdout


@pytest.mark.mpi
def test_pipeline_stages_count_their_point_to_point_sends(tmp_path):
    """2 stages cut after the first hidden layer (32 values a row), one replica (its Allreduce
    sends nothing): stage 0 sends each row's activations, stage 1 their gradients and, per
    micro-batch, the loss and correct count (`pipeline.engine`'s tail of 2 values)."""
    run_dir, epochs, summary = _run(tmp_path, ["parallel.pipeline_stages=2", "parallel.cut_points=[act0]",
                                               "model.hidden=[32,16]", "train.batch_size=24",
                                               "parallel.microbatches=4"], epochs=1)
    stage0, stage1 = sorted(summary["ranks"], key=lambda r: r["rank"])
    rows, micro = stage0["samples"], 4 * epochs[0]["steps"]    # 24-row batches of 4 micro-batches
    assert rows > 0 and stage1["samples"] == rows
    assert stage0["wire_bytes"] == rows * 32 * ITEM
    assert stage1["wire_bytes"] == (rows * 32 + micro * 2) * ITEM
    _check_sums(epochs, summary)
