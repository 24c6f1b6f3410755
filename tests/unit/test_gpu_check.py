"""bench/gpu_check.sh, the one chance a GPU machine gets: its section limits add up to at most
10 minutes with the install, it runs every gpu-marked test, and bench/gpu/covered.py lists the
cases it ran from pytest's report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "bench" / "gpu_check.sh").read_text()


def setting(name: str) -> int:
    found = re.findall(rf"^{name}=(?:\$\{{{name}:-)?(\d+)", SCRIPT, re.M)
    assert len(found) == 1, (name, found)
    return int(found[0])


def test_the_section_limits_add_up_to_at_most_ten_minutes_with_the_install():
    limits = {name: int(v) for name, v in re.findall(r"^(LIMIT_\w+)=(\d+)", SCRIPT, re.M)}
    probes = re.search(r"^for cand in (.*); do$", SCRIPT, re.M).group(1).count('"$(')  # mpirun candidates
    assert probes == 3
    sections = re.findall(r'^\s*run_section (\S+) "\$(LIMIT_\w+)"', SCRIPT, re.M)
    # every section runs under a named limit, the installs included, none under a bare number
    assert not re.findall(r"^\s*run_section \S+ \d", SCRIPT, re.M)
    assert {name for name, _ in sections} == {"install", "preflight", "doctor", "gradcheck", "train-1", "train-2",
                                              "throughput"}
    used = {limit for _, limit in sections}
    run_once = sum(limits[k] for k in used) + setting("KILL_AFTER") * len(used)
    worst = run_once + probes * limits["LIMIT_PROBE"] + limits["LIMIT_COVERED"]
    assert setting("CHECK_S") == 600 and worst <= 600, (worst, limits)
    assert 'timeout "$LIMIT_PROBE"' in SCRIPT and 'timeout "$LIMIT_COVERED"' in SCRIPT
    # the training runs fit their sections: runs x per-run timeout
    for section, runs in (("single", 3), ("pair", 4)):
        per_run = int(re.search(rf"--set {section} .*--timeout (\d+)", SCRIPT).group(1))
        limit = limits["LIMIT_TRAIN1" if section == "single" else "LIMIT_TRAIN2"]
        assert runs * per_run <= limit, (section, runs, per_run, limit)


def test_the_check_runs_every_gpu_marked_test():
    """The script collects the files that hold a gpu mark: its own grep finds each of them."""
    line = re.search(r"^mapfile -t GPU_TESTS < <\((.+)\)$", SCRIPT, re.M).group(1)
    assert '"${GPU_TESTS[@]}"' in SCRIPT.split("run_section gradcheck", 1)[1].split("\n\n", 1)[0]
    found = subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=60).stdout.split()
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                    if re.search(r"mark\.gpu\b", p.read_text()))
    assert len(marked) >= 9 and sorted(found) == marked, (found, marked)


def test_covered_lists_each_case_with_its_outcome(tmp_path):
    report = tmp_path / "gpu.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.unit.graph.test_gpu_kernels" name="test_winograd[cupy-2x64x4x4-f32]"/>'
        '<testcase classname="tests.unit.graph.test_gpu_kernels" name="test_winograd[cupy-2x64x2x2-f64]">'
        '<failure message="assert 0.1 &lt;= 1e-10"/></testcase>'
        '<testcase classname="tests.mpi.device.test_gpu_lanes" name="test_two_gpus">'
        '<skipped message="needs 2 GPUs"/></testcase>'
        '</testsuite></testsuites>')
    out = tmp_path / "results.md"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "covered.py"), str(report), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc  # a failed case fails the section
    text = out.read_text()
    assert "3 cases: 1 passed, 1 failed, 1 skipped." in text
    assert "| test_gpu_kernels | test_winograd | 1 | 1 | 0 |" in text
    assert "passed    test_gpu_kernels::test_winograd[cupy-2x64x4x4-f32]" in text
    assert "skipped: needs 2 GPUs" in text
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "covered.py"), str(tmp_path / "none.xml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no test report" in proc.stdout
