"""Engine vs PyTorch CPU step time on the two MLPerf HPC workloads: mini CosmoFlow (3-D
convolutions with 'same' padding, 3-D max pooling) and mini DeepCAM (a DeepLabv3+: atrous
convolutions, ASPP, bilinear resize, batch norm), as tests/support/mlperf_hpc.py defines them.

    .venv/bin/python bench/bench_mlperf_hpc.py [--rounds 3] [--repeats 3] [--steps 3] [--batch 4]
                                               [--only cosmoflow,deepcam] [--out FILE]

Each model is exported by torch (dynamo, training form) and imported as `model=onnx` would;
the engine steps the imported graph (forward, backward, SGD update), PyTorch the module it came
from (the same loss: MSE for CosmoFlow, cross-entropy over the class axis for DeepCAM), float32,
one BLAS thread on both sides, one process, the two taking turns inside every repeat
(`bench_engine.race`). Both are fed float32 batches (hpc_rlx casts CosmoFlow's int16 counts per
batch before the graph; that cast is not timed here). Each round's figures (best and median
wall, best CPU per step) go to a JSON lines file (`--out`, default
bench/results/mlperf_hpc.jsonl), one line per round and contender; the table is the median
over rounds. Where the engine is slower than PyTorch (ratio > 1.0), its time per op type is
printed (`bench_engine.print_profile`: each node's forward + backward on a synthetic batch).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import git_commit  # noqa: E402
from bench_engine import LR, engine_step_fn, print_profile, race  # noqa: E402

from hpc_rlx.device.host_blas import host_array_module  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def torch_step_fn(model, x, y, loss_fn):
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def case(name: str, batch: int, tmp: Path):
    """(title, imported graph and initial weights, torch module, x, y, loss function)."""
    import torch

    from hpc_rlx.graph.onnx.importer import import_onnx
    from tests.support import mlperf_hpc as m

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    if name == "cosmoflow":
        module = m.MiniCosmoFlow(dropout=0.0)
        samples = [m.cosmoflow_sample(rng) for _ in range(batch)]
        x = np.stack([s[0] for s in samples]).astype(np.float32)
        y = np.stack([s[1] for s in samples]).astype(np.float32)
        loss, title = torch.nn.functional.mse_loss, f"mini CosmoFlow {'x'.join(map(str, m.COSMO_SHAPE))} int16 " \
                                                       f"counts as float32, 5 x Conv3D k=2 'same', batch {batch}"
        imported = import_onnx(m.export(module, torch.from_numpy(x[:2]), tmp / f"{name}.onnx"), loss="mse",
                               label_dtype="float")
    else:
        minval = (10.0 ** rng.uniform(-3, 4, 16)).astype(np.float32)
        maxval = minval * 10
        module = m.MiniDeepCAM(minval, maxval)
        samples = [m.deepcam_sample(rng, minval, maxval) for _ in range(batch)]
        x = np.stack([s[0] for s in samples]).astype(np.float32)
        y = np.stack([s[1] for s in samples]).astype(np.int64)
        loss = torch.nn.functional.cross_entropy
        title = f"mini DeepCAM {'x'.join(map(str, m.DEEPCAM_SHAPE))} DeepLabv3+ (atrous, ASPP, bilinear), batch {batch}"
        imported = import_onnx(m.export(module, torch.from_numpy(x[:2]), tmp / f"{name}.onnx"),
                               loss="cross_entropy", label_dtype="int64")
    params = sum(p.numel() for p in module.parameters())
    return f"{title}, {params} parameters", imported, module.train(), x, y, loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per round (best and median kept)")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--only", default="cosmoflow,deepcam")
    ap.add_argument("--mkl", action="store_true", help="also race engine-mkl (device.cpu_blas=mkl)")
    ap.add_argument("--profile", action="store_true", help="the engine's time per op type even where it is ahead")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "mlperf_hpc.jsonl")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"bench": "mlperf_hpc", "commit": git_commit(),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
             "batch": args.batch, "threads": 1, "dtype": "float32", "numpy": np.__version__,
             "torch": torch.__version__, "load_before": round(os.getloadavg()[0], 2)}
    with threadpool_limits(limits=1), tempfile.TemporaryDirectory() as tmp, open(args.out, "w") as out:
        print(f"numpy {np.__version__}, torch {torch.__version__}, 1 BLAS thread, float32, {args.rounds} rounds "
              f"x {args.repeats} repeats x {args.steps} steps")
        for name in args.only.split(","):
            title, imported, module, x, y, loss = case(name, args.batch, Path(tmp))
            feeds = {"x": x, "y": y}
            contenders = {"engine": engine_step_fn(imported.graph, feeds, initial=imported.initial),
                          "torch": torch_step_fn(module, torch.from_numpy(x), torch.from_numpy(y), loss)}
            if args.mkl:        # the engine with device.cpu_blas=mkl's GEMMs
                contenders["engine-mkl"] = engine_step_fn(imported.graph, feeds, initial=imported.initial,
                                                          xp=host_array_module("mkl", 1))
            per_round = []
            for r in range(args.rounds):
                t = race(contenders, args.steps, args.repeats, warmup=1 if r else 2)
                per_round.append(t)
                for who, (best, med, cpu) in t.items():
                    out.write(json.dumps({**stamp, "case": name, "title": title, "round": r, "contender": who,
                                          "wall_best_s": best, "wall_median_s": med, "cpu_best_s": cpu}) + "\n")
                out.flush()
            report(title, per_round)
            ratio = statistics.median(t["engine"][2] / t["torch"][2] for t in per_round)     # cpu: load-proof
            if ratio > 1.0 or args.profile:
                with np.errstate(invalid="ignore"):         # the profile's batch is random normal: log(1 + x)
                    print_profile(imported.graph, args.batch, top=10)
    print(f"raw rounds: {args.out}")


def report(title, rounds):
    print(title)
    for who in rounds[0]:
        best = statistics.median(t[who][0] for t in rounds)
        med = statistics.median(t[who][1] for t in rounds)
        cpu = statistics.median(t[who][2] for t in rounds)
        print(f"  {who:7s} wall best {best * 1e3:8.1f} ms  median {med * 1e3:8.1f} ms  cpu best {cpu * 1e3:8.1f} ms"
              f"   (median of {len(rounds)} rounds)")
    ratios = [t["engine"][0] / t["torch"][0] for t in rounds]
    cpu_ratios = [t["engine"][2] / t["torch"][2] for t in rounds]
    print(f"  ratio engine/torch per round (best wall): {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f} wall, {statistics.median(cpu_ratios):.2f} cpu")
    if "engine-mkl" in rounds[0]:
        mkl = [t["engine-mkl"][2] / t["torch"][2] for t in rounds]
        print(f"  ratio engine-mkl/torch per round (best cpu): {', '.join(f'{r:.2f}' for r in mkl)}; "
              f"median {statistics.median(mkl):.2f}")


if __name__ == "__main__":
    main()
