"""Trains a few SGD steps pipelined (pipeline/engine.py, lanes.py) and, on every rank, the same
steps on the whole graph in one process; writes each rank's worst relative difference.

Usage: mpirun -n N python pipeline_train.py JOB.json OUT_DIR
JOB: {"model", "args", "stages", "micro", "schedule", "batch", "steps", "cut_points" (optional)}.
Rank r writes OUT_DIR/r<r>.json: {"stage", "replica", "param_rel", "loss_rel", "losses", "ref_losses"}.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpc_rlx.comm.bucket_layout import STEP_FIELDS
from hpc_rlx.comm.collective import FusedBucket
from hpc_rlx.graph import Executor, ParamLayout, build_model, init_params
from hpc_rlx.graph.partition import partition
from hpc_rlx.pipeline.engine import StageEngine
from hpc_rlx.pipeline.grid import split
from hpc_rlx.pipeline.adapters import PipelineBucket, PipelineLaneSet


def batch(model, args, rng, b):
    if model == "transformer_lm":
        v, t = args["vocab_size"], args["seq_len"]
        return rng.integers(0, v, (b, t)), rng.integers(0, v, (b, t))
    shape = tuple(args["input_shape"])
    return rng.standard_normal((b,) + shape), rng.integers(0, args["num_classes"], b)


def main():
    job = json.load(open(sys.argv[1]))
    out = sys.argv[2]
    world = MPI.COMM_WORLD
    comms = split(world, job["stages"])
    g = build_model(job["model"], **job["args"])
    stages = partition(g, job["stages"], cut_points=job.get("cut_points"))
    st = stages[comms.stage]
    full = ParamLayout(g)
    ref = np.empty(full.size)
    init_params(g, ref, seed=3)
    rv = full.views(ref)
    layout = ParamLayout(st)
    params = np.empty(layout.size)
    pv = layout.views(params)
    for p in st.params:
        pv[p.name][...] = rv[p.name]
    D, B, lr = comms.grid.replicas, job["batch"], 0.05
    engine = StageEngine(st, comms, job["schedule"], job["micro"], -(-B // D), "float64")
    bucket = PipelineBucket(FusedBucket(layout.size, STEP_FIELDS, np.float64), comms)
    lanes = PipelineLaneSet(engine, params, layout, bucket)
    ex = Executor(g, np, "float64")
    rgrad = np.empty(full.size)
    rng = np.random.default_rng(11)
    losses, ref_losses = [], []
    for step in range(job["steps"]):
        x, y = batch(job["model"], job["args"], rng, B)
        part = np.array_split(np.arange(B), D)[comms.replica]
        n, loss_sum, correct, _ = lanes.step(x[part], y[part], seed=step)
        bucket.zero_tail()
        bucket["samples"], bucket["loss_sum"], bucket["correct"] = n, loss_sum, correct
        bucket.allreduce()
        params[...] -= lr * bucket.payload / bucket["samples"]
        losses.append(bucket["loss_sum"] / bucket["samples"])
        o = ex.forward_backward(rv, full.views(rgrad), {"x": x, "y": y}, seed=step, grad_scale=1.0)
        ref -= lr * rgrad
        ref_losses.append(o["loss"])
    val_x, val_y = batch(job["model"], job["args"], rng, 7)
    vl, vc = lanes.evaluate(val_x, val_y)
    buf = np.array([vl, vc])
    comms.pipe.Bcast(buf, root=comms.stages - 1)
    val_ref = ex.evaluate(rv, {"x": val_x, "y": val_y})["loss"] * 7
    # relative per parameter; attention's key bias stays zero up to rounding: floored at the model's scale
    floor = 1e-3 * float(np.max(np.abs(ref)))
    rel = max(float(np.max(np.abs(pv[p.name] - rv[p.name])) / max(np.max(np.abs(rv[p.name])), floor))
              for p in st.params) if st.params else 0.0
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    with open(f"{out}/r{world.rank}.json", "w") as f:
        json.dump({"stage": comms.stage, "replica": comms.replica, "param_rel": rel, "loss_rel": loss_rel,
                   "val_rel": abs(buf[0] - val_ref) / abs(val_ref), "losses": losses,
                   "ref_losses": ref_losses, "params": [p.name for p in st.params],
                   "boundary_bytes": engine.boundary_bytes(), "slots": engine.slots}, f)


if __name__ == "__main__":
    main()
