"""`comm.shard=optimizer` (ZeRO-1 over MPI) in real `mpirun` jobs, float64: sharded and whole
optimizer state train the same model, checkpoints move between the two and across world
sizes, and each rank reports the state it holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpc_rlx.comm.codec import CODECS
from hpc_rlx.base.even_split import segments

from tests.mpi.runtime.test_end_to_end import load_params, max_rel_diff
from tests.support.jobs import explain, mpirun, train_job

pytestmark = pytest.mark.mpi

BASE = ["train.dtype=float64", "train.epochs=2", "train.batch_size=24", "data.leftover=partial",
        "model.hidden=[32,16]", "optim.lr=0.05"]
ADAMW = ["optim=adamw", "optim.lr=0.003"]


def _ranks(run: Path) -> list[dict]:
    return json.loads((run / "summary.json").read_text())["ranks"]


def _pair(tmp_path: Path, ranks: int, overrides: list[str], name: str) -> tuple[Path, Path]:
    """The same job with whole and with sharded optimizer state."""
    runs = []
    for shard in ("none", "optimizer"):
        run = tmp_path / f"{name}-{shard}"
        proc = train_job(ranks, run, overrides + ["checkpoint=off", f"comm.shard={shard}"], timeout=240)
        assert proc.returncode == 0, f"{name}, comm.shard={shard}: " + explain(proc)
        runs.append(run)
    return runs[0], runs[1]


@pytest.mark.parametrize("ranks, extra", [
    (2, ["optim.momentum=0.9"]),                                   # SGD with momentum
    (4, ["optim.momentum=0.9"]),
    (4, ADAMW),
    (2, ADAMW + ["optim.clip_grad_norm=0.5", "device.cpu_lanes=2"]),   # the global norm from the slices
], ids=["sgd-momentum-2", "sgd-momentum-4", "adamw-4", "adamw-clip-lanes-2"])
def test_sharded_state_trains_the_same_model_and_holds_a_slice(tmp_path, digits_h5, ranks, extra):
    whole, sharded = _pair(tmp_path, ranks, BASE + [f"data.path={digits_h5}"] + extra, "job")
    diff = max_rel_diff(load_params(whole), load_params(sharded))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e}"
    full, parts = _ranks(whole), _ranks(sharded)
    # every rank holds all the parameters, and 1/N of the optimizer state (its slices cover it once)
    assert [r["param_bytes"] for r in parts] == [r["param_bytes"] for r in full]
    assert sum(r["optimizer_bytes"] for r in parts) == full[0]["optimizer_bytes"]
    assert max(r["optimizer_bytes"] for r in parts) <= full[0]["optimizer_bytes"] / ranks + 8 * 4, parts
    assert "reduce-scatter (comm.shard=optimizer)" in (sharded / "hpc_rlx.log").read_text()


WIRE_STEPS = Path(__file__).resolve().parents[2] / "support" / "mpi_scripts" / "wire_steps.py"
BF16 = CODECS["bfloat16"]


@pytest.fixture(scope="module")
def wire_job(tmp_path_factory, digits_h5) -> Path:
    """One 3-rank job: the two paths on the same buckets, and one training step each way."""
    out = tmp_path_factory.mktemp("wire_steps")
    proc = mpirun(3, [str(WIRE_STEPS), str(digits_h5), str(out), "paths", "wire", "wire_sharded"], timeout=180)
    assert proc.returncode == 0, explain(proc)
    return out


def _owner_sum(codec, inputs: np.ndarray, blocks) -> np.ndarray:
    """What an owner adds: every rank's coded block decoded, in float32, in rank order."""
    total = np.zeros(inputs.shape[1], np.float32)
    for x in inputs:
        total += np.concatenate([codec.round_trip(x[a:b]) for a, b in blocks])
    return total


def test_the_sharded_and_the_whole_16_bit_wire_add_the_same_codes(wire_job):
    """Both paths code every rank's values and add the codes in float32 in rank order at the
    owner: the sums are bitwise the same. They differ in one rounding: the whole wire codes each
    owner's sum once more for the other ranks, the sharded one steps the owner's slice with the
    float32 sum (its allgather carries parameters, not codes). So whole == the codec's rounding
    of sharded, bitwise, which is within one 16-bit rounding of it (2**-8 relative for bfloat16;
    float16's block scale keeps its 2**-11 above the subnormals)."""
    seen = sorted(p.name for p in wire_job.glob("paths-*.npz"))
    assert seen == ["paths-bfloat16-1.npz", "paths-bfloat16-4.npz", "paths-float16-1.npz"], seen
    for path in seen:
        got = np.load(wire_job / path)
        codec = CODECS[path.split("-")[1]]
        inputs = got["inputs"]
        # one chunk: both cut the payload into the same owner segments, so the float16 blocks
        # (one scale each) are the same; bfloat16 codes each value alone, so any cut will do
        blocks = segments(inputs.shape[1], inputs.shape[0])
        total = _owner_sum(codec, inputs, blocks)
        assert np.array_equal(got["sharded"], total), path
        again = np.concatenate([codec.round_trip(total[a:b].astype(np.float64)) for a, b in blocks])
        assert np.array_equal(got["whole"], again), path
        bound = codec.unit_roundoff * np.abs(total) + (2.0 ** -134 if codec.name == "bfloat16" else
                                                        2.0 ** -37 * float(np.abs(total).max()))
        assert np.all(np.abs(got["whole"] - got["sharded"]) <= bound), path
        assert np.any(got["whole"] != got["sharded"]), path       # the one rounding is there


def test_a_sharded_step_on_the_16_bit_wire_is_the_whole_step_within_one_rounding(wire_job):
    """One SGD step of the same run, whole and sharded, on a bfloat16 wire: the same start and
    the same gradients sent; the sharded owner steps with the float32 sum S of the decoded
    codes, the whole wire with bfloat16(S), bitwise. The parameters are then bitwise equal where
    bfloat16(S) = S and elsewhere within lr / samples x |bfloat16(S) - S| <= lr / samples x
    2**-8 |S| (and the last bits of the subtraction)."""
    whole, sharded = np.load(wire_job / "wire.npz"), np.load(wire_job / "wire_sharded.npz")
    ranks, n = whole["sent"].shape
    assert np.array_equal(whole["before"], sharded["before"]) and np.array_equal(whole["sent"], sharded["sent"])
    total = _owner_sum(BF16, whole["sent"], [(0, n)]).astype(np.float64)
    coded = BF16.round_trip(total).astype(np.float64)
    for r, (lo, hi) in enumerate(segments(n, ranks)):
        assert np.array_equal(whole["applied"][r], coded), r
        assert np.array_equal(sharded["applied"][r][lo:hi], total[lo:hi]), r
    scale = float(whole["scale"][0])
    a, b = whole["after"][0], sharded["after"][0]
    assert all(np.array_equal(b, other) for other in sharded["after"])    # the allgather: one model
    same = coded == total
    assert np.array_equal(a[same], b[same])
    slack = 2 * np.spacing(np.maximum(np.abs(a), np.abs(b)))
    assert np.all(np.abs(a - b) <= scale * np.abs(coded - total) + slack)
    assert np.all(np.abs(a - b) <= scale * 2.0 ** -8 * np.abs(total) + slack)
    assert not np.all(same)


def test_deterministic_sharded_runs_repeat_bitwise(tmp_path, digits_h5):
    """Under comm.deterministic the reduce-scatter adds every rank's slice in rank order (as the
    ordered Allreduce does) and the clipping norm sums the slices' shares in rank order: two
    sharded runs are bitwise equal. On one node the reduce-scatter runs in the node's shared
    memory (comm/node_scatter.py) with the same additions as over MPI: a run with
    comm.shared_memory=false is bitwise equal too."""
    overrides = BASE + [f"data.path={digits_h5}", "comm.deterministic=true", "optim.clip_grad_norm=0.5",
                        "checkpoint=off", "comm.shard=optimizer"] + ADAMW
    runs = {"first": [], "again": [], "over_mpi": ["comm.shared_memory=false"]}
    for name, extra in runs.items():
        proc = train_job(2, tmp_path / name, overrides + extra, timeout=240)
        assert proc.returncode == 0, explain(proc)
    logs = {name: (tmp_path / name / "hpc_rlx.log").read_text() for name in runs}
    assert "path node shared memory (2 ranks), reduce-scatter (comm.shard=optimizer)" in logs["first"], logs["first"]
    assert "path host" in logs["over_mpi"] and "node shared memory" not in logs["over_mpi"], logs["over_mpi"]
    a = load_params(tmp_path / "first")
    for name in ("again", "over_mpi"):
        b = load_params(tmp_path / name)
        for k in a:
            assert np.array_equal(a[k], b[k]), f"{name}, {k}: max abs difference {np.abs(a[k] - b[k]).max():.3e}"


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, digits_h5) -> Path:
    """The uninterrupted unsharded run the resumed ones are compared with."""
    run = tmp_path_factory.mktemp("shard_ref") / "run"
    proc = train_job(2, run, BASE + [f"data.path={digits_h5}", "checkpoint=off"] + ADAMW, timeout=240)
    assert proc.returncode == 0, explain(proc)
    return run


@pytest.mark.parametrize("first, then", [((4, "optimizer"), (2, "none")), ((2, "none"), (4, "optimizer"))],
                         ids=["sharded-4-then-whole-2", "whole-2-then-sharded-4"])
def test_a_checkpoint_resumes_with_sharding_switched_and_another_world_size(tmp_path, digits_h5, straight_run,
                                                                          first, then):
    base = BASE + [f"data.path={digits_h5}"] + ADAMW
    run = tmp_path / "run"
    # stop in the middle of the second epoch (1438 rows, 24 a step: 60 steps an epoch)
    proc = train_job(first[0], run, base + [f"comm.shard={first[1]}", "train.max_steps=75"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    proc = train_job(then[0], run, base + [f"comm.shard={then[1]}"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert f"written on {first[0]} ranks, shards re-planned for {then[0]}" in proc.stdout, explain(proc)
    diff = max_rel_diff(load_params(straight_run), load_params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e} from the straight run"


def test_sharded_and_whole_state_within_pipeline_stages_train_the_same_model(tmp_path, digits_h5):
    """4 ranks as 2 stages of 2 replicas, AdamW with clipping: sliced between each stage's
    replicas or whole on each, the two runs end with the same parameters; each stage's replicas
    hold halves of what its ranks hold unsharded."""
    # parallel.balance=params: the two runs split the model alike (a split by measured time may
    # differ between them on a busy machine, and each stage's state with it)
    overrides = BASE + [f"data.path={digits_h5}", "parallel.pipeline_stages=2", "parallel.balance=params",
                        "optim.clip_grad_norm=0.5"] + ADAMW
    whole, sharded = _pair(tmp_path, 4, overrides, "stages")
    diff = max_rel_diff(load_params(whole), load_params(sharded))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e}"
    full, parts = _ranks(whole), _ranks(sharded)
    for s in range(2):  # ranks s and s + 2 hold stage s
        assert parts[s]["optimizer_bytes"] + parts[s + 2]["optimizer_bytes"] == full[s]["optimizer_bytes"], (full, parts)
    assert "reduce-scatter (comm.shard=optimizer)" in (sharded / "hpc_rlx.log").read_text()


def test_sharded_state_within_pipeline_stages_trains_the_model_and_resumes_unsharded(tmp_path, digits_h5):
    """4 ranks as 2 stages of 2 replicas: each stage's state sliced between its replicas, the
    clipping norm summed over the slices and then the stages. Stopped mid-epoch, the run resumes
    on 2 ranks without stages or sharding and ends where a straight run of that setup ends."""
    base = BASE + [f"data.path={digits_h5}", "optim.clip_grad_norm=0.5"] + ADAMW
    straight = tmp_path / "straight"
    proc = train_job(2, straight, base + ["checkpoint=off"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    run = tmp_path / "run"
    proc = train_job(4, run, base + ["parallel.pipeline_stages=2", "comm.shard=optimizer", "train.max_steps=75"],
                     timeout=300)
    assert proc.returncode == 0, explain(proc)
    assert "reduce-scatter (comm.shard=optimizer)" in (run / "hpc_rlx.log").read_text()
    ranks = _ranks(run)
    # the replicas of a stage (ranks s and s + 2 hold stage s) split its state between them
    for s in range(2):
        pair = [ranks[s]["optimizer_bytes"], ranks[s + 2]["optimizer_bytes"]]
        assert 0 < max(pair) <= sum(pair) / 2 + 8 * 4, ranks
    proc = train_job(2, run, base, timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert "written on 4 ranks, shards re-planned for 2" in proc.stdout, explain(proc)
    diff = max_rel_diff(load_params(straight), load_params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e} from the straight run"


def test_one_copy_of_the_parameters_per_node_trains_the_same_model_and_resumes(tmp_path, digits_h5, straight_run):
    """comm.node_shared_params: 4 ranks of one node read one parameter array and write their
    slices into it. The run equals the unsharded one; rank 0 alone reports the node's parameter
    bytes, one rank's unsharded figure (one copy on the node), and the ranks' optimizer bytes
    add up to one rank's unsharded figure, 1/4 each; a checkpoint taken mid-epoch resumes into
    the shared array (written once)."""
    base = BASE + [f"data.path={digits_h5}"] + ADAMW
    run = tmp_path / "run"
    shared = ["comm.shard=optimizer", "comm.node_shared_params=true"]
    proc = train_job(4, run, base + shared + ["train.max_steps=75"], timeout=240)
    assert proc.returncode == 0, explain(proc)
    whole, ranks = _ranks(straight_run), _ranks(run)
    assert [r["param_bytes"] for r in ranks] == [whole[0]["param_bytes"], 0, 0, 0], (ranks, whole)
    assert sum(r["optimizer_bytes"] for r in ranks) == whole[0]["optimizer_bytes"], (ranks, whole)
    assert max(r["optimizer_bytes"] for r in ranks) <= whole[0]["optimizer_bytes"] / 4 + 8 * 4, ranks
    proc = train_job(4, run, base + shared, timeout=240)
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stdout, explain(proc)
    assert _ranks(run)[0]["param_bytes"] == whole[0]["param_bytes"]
    diff = max_rel_diff(load_params(straight_run), load_params(run))
    assert diff <= 1e-10, f"max relative parameter difference {diff:.3e} from the straight run"
