"""Run report: time-split math, PNGs that load and have the expected size, the text summary,
sweep directories, the command line, and the plots a real run writes at its end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlx.report import text as report
from hpc_rlx.base.errors import HpcRlxError

from tests.support.jobs import REPO, explain, mpirun, read_metrics, with_read_only

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _epoch(e, compute, comm, data=0.0, eval_s=0.01, ckpt=0.0, other=0.02, cpu_share=1.0):
    wall = compute + comm + data + eval_s + ckpt + other
    return {"epoch": e, "steps": 10, "compute_s": compute, "comm_s": comm, "data_s": data,
            "eval_s": eval_s, "checkpoint_s": ckpt, "epoch_s": wall, "cpu_s": cpu_share * wall}


def make_run(path: Path, epochs: int = 5, ranks: int = 3, slow_rank: int = 2,
             per_rank_epochs: bool = True, with_summary: bool = True, starved: tuple = ()) -> Path:
    path.mkdir(parents=True)
    with open(path / "metrics.jsonl", "w") as f:
        for e in range(1, epochs + 1):
            f.write(json.dumps({
                "epoch": e, "step": 10 * e, "train_loss": 2.0 / e, "train_accuracy": 1 - 0.5 / e,
                "val_loss": 2.2 / e, "val_accuracy": 1 - 0.6 / e, "lr": 0.1 / e,
                "samples_per_s": 1000.0 + e, "compute_s": 0.5, "comm_s": 0.2, "data_s": 0.3 if e == 1 else 0.0,
                "epoch_s": 1.1, "steps": 10, "policy": "sync"}) + "\n")
    if not with_summary:
        return path
    rank_recs = []
    for r in range(ranks):
        compute = 1.5 if r == slow_rank else 0.5
        comm = 0.1 if r == slow_rank else 1.1      # the others wait for the slow one
        eps = [_epoch(e, compute, comm, data=0.3 if e == 1 else 0.001, cpu_share=0.4 if r in starved else 0.98)
               for e in range(1, epochs + 1)]
        rec = {"rank": r, "host": f"node{r // 2}", "lanes": ["cpu0", "cuda0"] if r == 0 else ["cpu0"],
               "inventory": ["cpu"], "samples": 640 * epochs, "threads": 1,
               "compute_s": compute * epochs, "comm_s": comm * epochs, "data_s": 0.3, "checkpoint_s": 0.0,
               "first_loss": 2.3, "last_loss": 0.2, "wall_s": 9.0,
               "lane_samples": {"cpu0": 600 * epochs, "cuda0": 40 * epochs} if r == 0 else {"cpu0": 640 * epochs},
               "lane_busy_s": {"cpu0": 0.4 * epochs, "cuda0": 0.01 * epochs} if r == 0 else {"cpu0": compute * epochs}}
        if per_rank_epochs:
            rec["epochs"] = eps
        rank_recs.append(rec)
    summary = {"status": "completed", "epochs_completed": epochs, "steps": 10 * epochs,
               "final": {"epoch": epochs, "val_loss": 2.2 / epochs, "val_accuracy": 1 - 0.6 / epochs,
                         "train_loss": 2.0 / epochs},
               "world_size": ranks, "ranks": rank_recs}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def png_shape(path: Path) -> tuple:
    from matplotlib.image import imread
    assert path.read_bytes()[:8] == PNG_MAGIC
    return imread(path).shape


# ---- math ----------------------------------------------------------------------------------

def test_other_is_the_unexplained_rest_and_never_negative():
    parts = report.epoch_parts(_epoch(1, 1.0, 0.5, data=0.25, other=0.125))
    assert parts["other_s"] == pytest.approx(0.125)
    assert sum(parts.values()) == pytest.approx(1.0 + 0.5 + 0.25 + 0.01 + 0.125)
    over = report.epoch_parts({"compute_s": 2.0, "epoch_s": 1.0})
    assert over["other_s"] == 0.0


def test_epoch_binning_keeps_totals_and_bounds_groups():
    eps = [dict(_epoch(e, 0.1 * e, 0.01), **report.epoch_parts(_epoch(e, 0.1 * e, 0.01))) for e in range(1, 101)]
    labels, groups = report.bin_epochs(eps, max_groups=40)
    assert len(groups) <= 40 and labels[0] == "1-3" and labels[-1].endswith("100")
    assert sum(g["compute_s"] for g in groups) == pytest.approx(sum(e["compute_s"] for e in eps))
    labels, groups = report.bin_epochs(eps[:5], max_groups=40)
    assert labels == ["1", "2", "3", "4", "5"]


def test_slowest_rank_is_found_by_compute_per_sample(tmp_path):
    files = report.load_run(make_run(tmp_path / "r", slow_rank=1))
    rank, ratio = report.slowest_rank(files)
    assert rank == 1 and ratio == pytest.approx(3.0)


def test_rank_time_falls_back_to_rank0_metrics(tmp_path):
    files = report.load_run(make_run(tmp_path / "r", per_rank_epochs=False))
    per = report.rank_epochs(files)
    assert list(per) == [0] and len(per[0]) == 5
    assert per[0][0]["data_s"] == 0.3 and per[0][0]["other_s"] == pytest.approx(0.1)


def test_varied_overrides_keep_only_what_differs():
    got = report.varied_overrides(["a=1 lr=0.1 p=sync", "a=1 lr=0.05 p=sync", "a=1 lr=0.1 p=cadence"])
    assert got == ["lr=0.1 p=sync", "lr=0.05 p=sync", "lr=0.1 p=cadence"]


# ---- files -----------------------------------------------------------------------------------

def test_plots_are_written_and_readable(tmp_path):
    run = make_run(tmp_path / "r")
    made = report.write_plots(run)
    assert [p.name for p in made] == ["curves.png", "rank_time.png", "lanes.png"]
    assert png_shape(run / "plots" / "curves.png")[:2] == (400, 1300)
    assert png_shape(run / "plots" / "rank_time.png")[:2] == (800, 1400)
    assert png_shape(run / "plots" / "lanes.png")[0] == 450
    assert not list((run / "plots").glob("*.tmp.png"))


def test_many_ranks_and_epochs_still_plot(tmp_path):
    run = make_run(tmp_path / "r", epochs=120, ranks=40, slow_rank=17)
    made = report.write_plots(run, out_dir=tmp_path / "elsewhere")
    assert len(made) == 3 and all(p.parent == tmp_path / "elsewhere" for p in made)
    assert "rank 17 is the slowest" in report.run_text(report.load_run(run))


def test_text_summary_names_the_slow_rank_and_the_numbers(tmp_path):
    text = report.run_text(report.load_run(make_run(tmp_path / "r")))
    assert "completed, 5 epochs, 50 steps, 3 ranks, policy sync" in text
    assert "val_loss 0.4400" in text
    assert "rank 2 is the slowest: 3.00x" in text
    assert "r0:cuda0" in text                      # non-trivial lanes are listed
    lines = [ln for ln in text.splitlines() if ln.strip().startswith("2 ")]
    assert lines and "7.500" in lines[0]            # rank 2's compute seconds


def test_a_run_still_going_reports_what_is_there(tmp_path):
    run = make_run(tmp_path / "r", with_summary=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 6, "train_lo')          # being written right now
    files = report.load_run(run)
    assert len(files.metrics) == 5 and files.summary is None
    assert "no summary.json" in report.run_text(files)
    assert [p.name for p in report.write_plots(run)] == ["curves.png", "rank_time.png"]


def test_a_corrupt_metrics_line_is_an_error_with_the_line(tmp_path):
    run = make_run(tmp_path / "r")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = "{oops"
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(HpcRlxError, match="line 2"):
        report.load_run(run)


def test_not_a_run_directory(tmp_path):
    with pytest.raises(HpcRlxError, match="does not exist"):
        report.load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HpcRlxError, match="neither metrics.jsonl nor summary.json"):
        report.load_run(tmp_path / "empty")


def make_sweep(path: Path) -> Path:
    for i, (lr, loss) in enumerate([(0.1, 0.3), (0.05, 0.2), (0.01, 0.9)]):
        p = make_run(path / str(i), epochs=2, ranks=2)
        s = json.loads((p / "summary.json").read_text())
        s["final"]["val_loss"] = loss
        (p / "summary.json").write_text(json.dumps(s))
        (p / "overrides.txt").write_text(f"data.path=/d.h5 optim.lr={lr}\n")
    return path


def test_sweep_plot_and_text(tmp_path):
    sweep = make_sweep(tmp_path / "sweep")
    assert report.is_sweep_dir(sweep) and not report.is_sweep_dir(sweep / "0")
    made = report.write_plots(sweep)
    assert made == [sweep / "sweep.png"] and png_shape(made[0])[1] == 1200
    # no new sub-directory that the sweep summary would take for a point
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2"]
    rows = report.sweep_rows(sweep)
    text = report.sweep_text(sweep, rows)
    assert "best val_loss 0.2000 at point 1 (optim.lr=0.05)" in text
    assert "common overrides: data.path=/d.h5" in text


def test_cli_on_run_and_sweep_and_errors(tmp_path):
    run = make_run(tmp_path / "r")
    cmd = [sys.executable, "-m", "hpc_rlx.report"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd + [str(run)], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "rank 2 is the slowest" in proc.stdout and "plots: " in proc.stdout
    assert (run / "plots" / "rank_time.png").is_file()
    sweep = make_sweep(tmp_path / "sweep")
    proc = subprocess.run(cmd + [str(sweep), "--points"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "sweep.png").is_file() and (sweep / "2" / "plots" / "curves.png").is_file()
    proc = subprocess.run(cmd + [str(tmp_path / "nope")], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=env)
    assert proc.returncode == 1 and str(tmp_path / "nope") in proc.stderr


def test_a_run_directory_one_cannot_write_still_gets_its_summary(tmp_path):
    """A read-only mount (an archive, a colleague's run): the summary, then one warning line
    that names where the plots could not go and the flags that choose another place; exit 0
    and the directory as it was. --out, as the warning says, writes them elsewhere."""
    run = make_run(tmp_path / "r")
    before = sorted(p.name for p in run.iterdir())
    cmd = [sys.executable, "-m", "hpc_rlx.report", str(run)]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "MPLCONFIGDIR": str(tmp_path / "mpl")}
    proc = subprocess.run(with_read_only(run, cmd), capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, explain(proc)
    assert "rank 2 is the slowest" in proc.stdout, explain(proc)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, explain(proc)
    assert lines[0].startswith("hpc_rlx.report: warning: plots not written: ") and str(run / "plots") in lines[0]
    assert "--out DIR" in lines[0] and "--no-plots" in lines[0], lines[0]
    assert sorted(p.name for p in run.iterdir()) == before
    out = tmp_path / "elsewhere"
    proc = subprocess.run(with_read_only(run, cmd + ["--out", str(out)]), capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0 and not proc.stderr.strip(), explain(proc)
    assert (out / "curves.png").is_file()


# ---- a real run ------------------------------------------------------------------------------

@pytest.mark.mpi
def test_run_writes_plots_and_per_rank_epoch_times(tmp_path, digits_h5):
    run = tmp_path / "run"
    # report.plots is left at its default (true), unlike the other runtime tests
    proc = mpirun(2, ["-m", "hpc_rlx", f"hydra.run.dir={run}", f"data.path={digits_h5}", "train.epochs=3",
                      "model.hidden=[16]", "checkpoint.every_epochs=1", "train.threads_per_rank=1"],
                  timeout=180)
    assert proc.returncode == 0, explain(proc)
    for name in ("curves.png", "rank_time.png", "lanes.png"):
        assert (run / "plots" / name).read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((run / "summary.json").read_text())
    metrics = read_metrics(run)
    for r in summary["ranks"]:
        assert r["threads"] == 1
        eps = r["epochs"]
        assert [e["epoch"] for e in eps] == [1, 2, 3]
        assert sum(e["compute_s"] for e in eps) == pytest.approx(r["compute_s"], rel=1e-9)
        assert sum(e["comm_s"] for e in eps) == pytest.approx(r["comm_s"], rel=1e-9)
        assert eps[0]["data_s"] >= r["data_s"] > 0          # the shard load lands in epoch 1
        assert all(e["checkpoint_s"] > 0 for e in eps)      # every_epochs=1
        for e in eps:
            parts = report.epoch_parts(e)
            assert sum(v for k, v in parts.items() if k != "other_s") <= e["epoch_s"] + 1e-6
    # rank 0's per-rank record and its metrics.jsonl line describe the same epoch
    r0 = next(r for r in summary["ranks"] if r["rank"] == 0)
    assert [e["compute_s"] for e in r0["epochs"]] == pytest.approx([m["compute_s"] for m in metrics])
    text = subprocess.run([sys.executable, "-m", "hpc_rlx.report", str(run), "--no-plots"],
                          capture_output=True, text=True, timeout=120, cwd=REPO).stdout
    assert "3 epochs" in text and "2 ranks" in text


@pytest.mark.mpi
def test_plots_off(tmp_path, digits_h5):
    run = tmp_path / "run"
    proc = mpirun(1, ["-m", "hpc_rlx", f"hydra.run.dir={run}", f"data.path={digits_h5}", "train.epochs=1",
                      "model.hidden=[16]", "checkpoint=off", "report.plots=false"], timeout=120)
    assert proc.returncode == 0, explain(proc)
    assert (run / "summary.json").is_file() and not (run / "plots").exists()


def test_trace_breakdown_per_step(tmp_path):
    def x(pid, name, dur_ms):
        return {"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": 0, "dur": dur_ms * 1e3}
    events = []
    for _ in range(4):
        events += [x(0, "step", 10), x(0, "forward_backward", 6), x(0, "allreduce", 3), x(0, "wait", 2),
                   x(1, "step", 10), x(1, "forward_backward", 8), x(1, "allreduce", 1)]
    events.append(x(0, "checkpoint", 50))           # not a step span
    per = report.trace_per_step({"traceEvents": events})
    assert per[0] == pytest.approx({"step": 10, "forward_backward": 6, "allreduce": 3, "wait": 2})
    assert per[1]["forward_backward"] == pytest.approx(8) and "wait" not in per[1]
    run = make_run(tmp_path / "r")
    (run / "trace.json").write_text(json.dumps({"traceEvents": events}))
    text = report.run_text(report.load_run(run))
    assert "ms per step" in text and "rank 1" in text.split("ms per step")[1]


def test_cpu_use_flags_ranks_that_waited_for_a_core(tmp_path):
    files = report.load_run(make_run(tmp_path / "a", ranks=4, starved=(1, 2)))
    use = report.cpu_use(files)
    assert use[0] == pytest.approx(0.98) and use[1] == pytest.approx(0.4)
    text = report.run_text(files)
    assert "cpu: ranks 1-2 used under 70% of a core" in text
    assert "cpu:" not in report.run_text(report.load_run(make_run(tmp_path / "b", ranks=4)))


def test_trace_without_step_spans_lists_totals(tmp_path):
    run = make_run(tmp_path / "r")
    events = [{"ph": "X", "pid": p, "tid": 0, "name": n, "ts": 0, "dur": d}
              for p in (0, 1) for n, d in (("forward_backward", 2e6), ("allreduce", 5e5), ("epoch 1", 9e6))]
    (run / "trace.json").write_text(json.dumps({"traceEvents": events}))
    tail = report.run_text(report.load_run(run)).splitlines()[-1]
    assert tail.strip() == "seconds, all ranks: forward_backward 4.000  allreduce 1.000"
