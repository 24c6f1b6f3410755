"""bench/compare_summary.py's geometric means on a small synthetic OUT_DIR, written as
bench/compare_checkouts.sh writes one: each figure counted once, the cpu-time twins and the
derived ratios (engine/torch, bucket/raw1) left out, a group below its bar flagged."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
import compare_summary  # noqa: E402


def _engine(wall: float, mkl_wall: float, cpu: float) -> str:
    line = "  {:14s} wall best {:7.2f} ms  median {:7.2f} ms  cpu best {:7.2f} ms   /torch: 1.00x wall, 1.00x cpu"
    return "\n".join(["numpy 2.0, torch 2.4, 1 BLAS thread, float32, 5 repeats x 20 steps", "MLP 784-10, batch 128",
                      line.format("engine", wall, wall, cpu), line.format("engine-mkl", mkl_wall, mkl_wall, cpu),
                      line.format("torch", 10.0, 10.0, 10.0)]) + "\n"


def _collective(bucket: float, raw1: float) -> str:
    return ("# bench_collective\nMiB  bucket ms  bucket/raw1\n---  ---------  -----------\n"
            f"1  {bucket:.3f}  {raw1:.3f}\n")


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    """One round. Ratios (>= 1: new not slower): engine 1.25 and 0.8; collective 0.9; full
    path 0.96 and 1.10. The twins and derived ratios are far off (cpu 0.5, engine/torch and
    bucket/raw1 0.25-0.8), so counting any of them moves the means."""
    (tmp_path / "engine.old.1.txt").write_text(_engine(10.0, 8.0, 10.0))
    (tmp_path / "engine.new.1.txt").write_text(_engine(8.0, 10.0, 20.0))
    (tmp_path / "collective.old.1.txt").write_text(_collective(0.18, 1.0))
    (tmp_path / "collective.new.1.txt").write_text(_collective(0.20, 4.0))
    (tmp_path / "full.sync.n2.old.1.json").write_text(json.dumps({"samples_per_s": 1000.0, "p25_samples_per_s": 500.0}))
    (tmp_path / "full.sync.n2.new.1.json").write_text(json.dumps({"samples_per_s": 960.0, "p25_samples_per_s": 550.0}))
    return tmp_path


def test_the_means_count_each_figure_once(out_dir):
    values, rounds = compare_summary.collect(out_dir)
    assert rounds == 1
    means = compare_summary.geometric_means({k: r for k, (_, _, r) in compare_summary.ratios(values).items()})
    engine, collective, full = (means[g] for g in ("engine", "collective", "full path"))
    assert engine[0] == pytest.approx(1.0)                   # sqrt(1.25 x 0.8), not their mean 1.025
    assert collective[0] == pytest.approx(0.9)
    assert full[0] == pytest.approx(math.sqrt(0.96 * 1.10))
    assert means["all"][0] == pytest.approx((1.25 * 0.8 * 0.9 * 0.96 * 1.10) ** (1 / 5))
    assert engine[1] == ["engine MLP: engine step, best wall (ms)", "engine MLP: engine-mkl step, best wall (ms)"]
    assert collective[1] == ["collective 1 MiB: bucket (ms)"]
    assert full[1] == ["full path, policy=sync, 2 rank(s): samples/s",
                       "full path, policy=sync, 2 rank(s): p25 step samples/s"]
    assert sorted(means["all"][1]) == sorted(engine[1] + collective[1] + full[1])


def test_the_output_names_each_group_and_flags_a_mean_below_its_bar(out_dir):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "compare_summary.py"), str(out_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    table = text[text.index("== geometric means"):text.index("-- engine group:")].splitlines()[1:]
    means = {line.split()[0]: line for line in table if line.split()[0] in ("all", "engine", "collective", "full")}
    assert means["collective"].endswith("<") and "0.900" in means["collective"]   # below 0.97
    assert not means["engine"].endswith("<") and "1.000" in means["engine"]
    assert not means["full"].endswith("<")
    assert not means["all"].endswith("<") and "0.990" in means["all"]   # at or above 0.98
    assert "1 of 4 means below their bar" in text
    groups = text[text.index("-- engine group:"):]
    assert "   collective 1 MiB: bucket (ms)" in groups and "bucket/raw1" not in groups
    assert "best cpu" not in groups and "/torch" not in groups
