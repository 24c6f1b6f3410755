"""Pipelined training steps under real mpirun (pipeline/engine.py, adapters.py): the stages' SGD
steps, exchanged by Isend/Irecv and reduced per stage over the replicas, end with the same
parameters, losses and validation loss as the whole graph trained in one process on the same
global batches (float64, relative <= 1e-10); GPipe and 1F1B; MLP, CNN, transformer LM;
S x D = 2x1, 2x2, 4x2 (8 ranks, oversubscribed); unequal micro-batches; cut points."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.jobs import launch_cmd

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "support" / "mpi_scripts" / "pipeline_train.py"
MLP = {"input_shape": [12], "num_classes": 5, "hidden": [16, 16, 16]}
CNN = {"input_shape": [1, 8, 8], "num_classes": 4, "channels": [4, 6], "hidden": 10}
LM = {"vocab_size": 11, "seq_len": 6, "d_model": 8, "n_heads": 2, "n_layers": 2, "d_ff": 16}


def run_pipeline(tmp_path, nranks, **job):
    job = {"batch": 8, "steps": 4, **job}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(launch_cmd(nranks, [str(SCRIPT), str(tmp_path / "job.json"), str(tmp_path)]),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(nranks)]
    for r in results:
        assert r["param_rel"] <= 1e-10 and r["loss_rel"] <= 1e-10 and r["val_rel"] <= 1e-10, r
    # every parameter lives on exactly one stage; replicas hold the same ones
    stages = job["stages"]
    names = [p for r in results[:stages] for p in r["params"]]
    assert len(names) == len(set(names))
    return results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("model,args", [("mlp", MLP), ("cnn", CNN), ("transformer_lm", LM)])
def test_two_stages_one_replica(tmp_path, model, args, schedule):
    res = run_pipeline(tmp_path, 2, model=model, args=args, stages=2, micro=4, schedule=schedule)
    # buffer slots: GPipe keeps M micro-batches alive on each stage, 1F1B at most S - s
    assert [r["slots"] for r in res] == ([4, 4] if schedule == "gpipe" else [2, 1])


def test_two_stages_two_replicas_unequal_micro_batches(tmp_path):
    # 11 rows over 2 replicas (6 + 5), 4 micro-batches each: 2,2,1,1 and 2,1,1,1
    run_pipeline(tmp_path, 4, model="transformer_lm", args=LM, stages=2, micro=4, schedule="1f1b", batch=11)


def test_four_stages_two_replicas_on_eight_ranks(tmp_path):
    run_pipeline(tmp_path, 8, model="cnn", args=CNN, stages=4, micro=3, schedule="1f1b", batch=10, steps=3)


def test_cut_points_carry_the_residual_stream(tmp_path):
    run_pipeline(tmp_path, 3, model="transformer_lm", args=LM, stages=3, micro=2, schedule="gpipe",
                 cut_points=["block0.ln1", "block1.attn_residual"])


def test_more_micro_batches_than_rows(tmp_path):
    run_pipeline(tmp_path, 2, model="mlp", args=MLP, stages=2, micro=8, schedule="1f1b", batch=5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [1, 4, 8])
@pytest.mark.parametrize("stages,replicas", [(2, 1), (2, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("model,args", [("mlp", MLP), ("cnn", CNN), ("transformer_lm", LM)])
def test_full_matrix(tmp_path, model, args, stages, replicas, micro, schedule):
    run_pipeline(tmp_path, stages * replicas, model=model, args=args, stages=stages, micro=micro,
                 schedule=schedule, batch=12, steps=3)
