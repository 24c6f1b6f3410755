"""bench/README.md's streaming, policy and LoRA tables are bench/tables.py's output on the raw
files kept under bench/results/ (one JSON line a job): a hand-edited figure, or a raw file changed
without the tables regenerated, fails here; so does a table over fewer than three seeds (LoRA's:
rounds)."""

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
            if r["bench"] == "lora_profile":       # one profiled job a side, beside the rounds
                continue
            key = (str(r["setting"]), r.get("row") or r.get("policy") or r.get("side"), r.get("slowdown"))
            seeds.setdefault(key, set()).add(r["round"] if r["bench"] == "lora" else r["seed"])
        thin = {k: s for k, s in seeds.items() if len(s) < 3}
        assert not thin, f"{name}: rows with fewer than 3 seeds (rounds): {thin}"


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


def _lora(side, rnd, step_ms, trainable=1000, wire=None, opt=None):
    rec = {"bench": "lora", "round": rnd, "side": side, "step_ms": step_ms, "trainable": trainable,
           "setting": {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 16,
                       "vocab_size": 30, "seq": 4, "ranks": 2, "batch_per_rank": 2, "steps": 2, "timed_epochs": 1,
                       "rank": 8, "alpha": 16, "targets": "[*query]", "optim": "adamw", "dtype": "float32",
                       "torch_copies": 2, "extra": []}}
    if side in ("full", "lora"):
        rec.update(wire_bytes_per_step=wire, optimizer_bytes=[opt, opt])
    else:
        rec.update(optimizer_bytes=opt)
    return rec


def test_lora_ratios_are_taken_within_each_round_and_judged_against_their_goals():
    records = []
    for rnd, (full, lora, peft) in enumerate([(100.0, 50.0, 40.0), (200.0, 160.0, 200.0), (100.0, 60.0, 60.0)]):
        records += [_lora("full", rnd, full, wire=6000, opt=1200), _lora("lora", rnd, lora, wire=100, opt=12),
                    _lora("torch_lora", rnd, peft, opt=8)]
    text = tables.lora_table(records)
    cells = {row[0]: row[1:] for row in ([c.strip() for c in line.strip("|").split("|")]
                                         for line in text.splitlines() if line.startswith("| "))}
    assert cells["hpc_rlx, LoRA"] == ["1,000", "90 (50-160)", "0.00", "0.00"]
    assert cells["bytes on the wire per step, full / LoRA"] == ["60x", ">= 50x", "yes"]
    assert cells["optimizer bytes per rank, full / LoRA"] == ["100x", "-", "-"]
    # 0.5, 0.8 and 0.6 in their rounds: mean 0.63 (not 270 / 400 = 0.675 from the sums); against PEFT
    # 1.25, 0.8 and 1.0: mean 1.017, over the goal
    assert cells["step time, LoRA / full (hpc_rlx)"] == ["0.63 (0.50-0.80)", "<= 0.75", "yes"]
    assert cells["step time, LoRA: hpc_rlx 2 ranks / PyTorch + PEFT, 2 processes at once"] == [
        "1.02 (0.80-1.25)", "<= 1.0", "no"]
    assert "step time, full: hpc_rlx / PyTorch" not in cells      # no PyTorch full fine-tuning rounds
