"""bench/bench_lora.py's arguments: a side it does not know, or no timed epoch, is refused before
anything is exported or launched (the benchmark itself runs by hand, never in the suite)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))
import bench_lora  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--sides", "full,qlora"], "--sides: unknown qlora"),
    (["--sides", ","], "--sides: unknown (none)"),
    (["--epochs", "1"], "--epochs must be at least 2"),
    (["--torch-copies", "0"], "--torch-copies"),
])
def test_bad_arguments_are_one_usage_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench_lora.main(argv + ["--out", str(tmp_path / "never.jsonl")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never.jsonl").exists()
