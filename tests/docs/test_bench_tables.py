"""bench/README.md's streaming and policy tables are bench/tables.py's output on the raw files
kept under bench/results/ (one JSON line a job): a hand-edited figure, or a raw file changed
without the tables regenerated, fails here; so does a table over fewer than three seeds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.docs.doc_blocks import REPO

sys.path.insert(0, str(REPO / "bench"))
import tables  # noqa: E402


def test_the_readme_tables_are_made_from_their_raw_files():
    proc = subprocess.run([sys.executable, "bench/tables.py", "--readme", "bench/README.md", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = [m.group(1) for m in tables.MARK.finditer((REPO / "bench" / "README.md").read_text())]
    assert any("streaming" in f for f in files) and any("policies" in f for f in files), files
    for name in files:
        records = tables.read_records(REPO / name)
        seeds: dict[tuple, set] = {}
        for r in records:
            key = (str(r["setting"]), r.get("row") or r.get("policy"), r.get("slowdown"))
            seeds.setdefault(key, set()).add(r["seed"])
        thin = {k: s for k, s in seeds.items() if len(s) < 3}
        assert not thin, f"{name}: rows with fewer than 3 seeds: {thin}"


def _streaming(row, seed, loss, wire=100, curve=((1.0, 9.0), (1.0, 1.0))):
    return {"bench": "streaming", "setting": {"ranks": 2, "link": None, "epochs": 2, "k": 5, "extra": []},
            "row": row, "label": row, "seed": seed, "syncs": 4, "val_loss": loss, "wire": wire,
            "curve": [list(c) for c in curve]}


def test_means_spread_and_ratios_against_sync_of_the_same_seed():
    records = [_streaming("sync", 1, 2.0, 1000), _streaming("sync", 2, 4.0, 1000),
               _streaming("diloco", 1, 1.0, 10, ((1.0, 3.0), (1.0, 1.0))),
               _streaming("diloco", 2, 4.0, 20, ((1.0, 5.0), (1.0, 4.0)))]
    text = tables.streaming_table(records)
    row = next(line for line in text.splitlines() if line.startswith("| diloco"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # loss 1 and 4: mean 2.5; against sync of the same seed 0.5 and 1.0 (not 2.5 / 3.0)
    assert cells[4] == "2.5000 (1.0000-4.0000)" and cells[5] == "0.7500 (0.5000-1.0000)"
    assert cells[3] == "75x"  # 1000/10 and 1000/20, averaged
    # seed 1 reached sync's 2.0 half-way through its second epoch; seed 2 at the end of it
    assert cells[6] == "1.8 (1.5-2.0)"
    assert tables.time_to([(1.0, 3.0), (1.0, 1.0)], 2.0) == pytest.approx(1.5)
    assert tables.time_to([(1.0, 3.0)], 2.0) is None
    assert tables.spread([1.0], ".2f") == "1.00"
