"""Rank 0's files in the run directory: config, graph, metrics.jsonl, model.h5, summary.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from hpc_rlx.base import run_dir_names as names
from hpc_rlx.comm import watchdog
from hpc_rlx.config import segments
from hpc_rlx.graph import Graph
from hpc_rlx.observe.plots import write_plots


def _keep_model_source(source: str, dest: Path) -> None:
    """The ONNX file as one self-contained file (torch's dynamo exporter keeps the weights in a
    `<file>.data` beside it, which a copy of the file alone would lose). Rank 0 of a model=onnx
    run has read the file with `onnx` already."""
    import onnx
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        onnx.save(onnx.load(source), str(tmp))
    except ValueError:      # over protobuf's 2 GB: the file itself, its data file beside it
        shutil.copyfile(source, tmp)
        for data in Path(source).parent.glob(Path(source).name + ".data"):
            shutil.copyfile(data, dest.parent / data.name)
    os.replace(tmp, dest)


class RunOutputs:
    """Rank 0's files in the run directory."""

    def __init__(self, spec, worker, log, lane_names: list[str]):
        self.spec, self.worker, self.log, self.lane_names = spec, worker, log, lane_names
        self.dir = Path(spec.run_dir)

    def start(self, resumed_from: str | None, resumed_config_yaml: str | None, world_size: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        segment = None
        if self.spec.config_yaml:
            # config.yaml for the first run here; a later run keeps it and adds its own
            segment = segments.start_segment(
                self.dir, self.spec.config_yaml, resumed_from=resumed_from,
                resumed_config_yaml=resumed_config_yaml, start_step=self.worker.step,
                start_epoch=self.worker.epoch, world_size=world_size)
        (self.dir / names.GRAPH).write_text(json.dumps(self.spec.graph, indent=1))
        source = self.spec.model_source
        if source:   # model=onnx: `python -m hpc_rlx.export` writes the trained weights into it
            _keep_model_source(source, self.dir / "model.source.onnx")
        if resumed_from:
            self._trim_metrics(self.worker.epoch)
        self.metrics = open(self.dir / names.METRICS, "a", buffering=1)
        if segment is not None:
            self.metrics.write(segments.dumps(segment) + "\n")
            self.log(segments.describe(segment))

    def _trim_metrics(self, epochs_done: int) -> None:
        """On resume, epochs past the checkpoint are trained again: their old records move to
        metrics.abandoned.jsonl so metrics.jsonl reads as one uninterrupted run."""
        path = self.dir / names.METRICS
        if not path.is_file():
            return
        keep, drop = [], []
        for line in path.read_text().splitlines():
            try:
                later = int(json.loads(line).get("epoch", 0)) > epochs_done
            except (ValueError, AttributeError, TypeError):
                later = False
            (drop if later else keep).append(line)
        if not drop:
            return
        with open(self.dir / "metrics.abandoned.jsonl", "a") as f:
            f.write("".join(line + "\n" for line in drop))
        tmp = self.dir / "metrics.jsonl.tmp"
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)

    def epoch(self, rec: dict) -> None:
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()

    def taken_over(self) -> "RunOutputs":
        """After rank 0 died, on the survivors' rank 0: append to metrics.jsonl from here on, a
        record the dead rank left half-written cut off first (no torn line). Returns self."""
        path = self.dir / names.METRICS
        if path.is_file():
            raw = path.read_bytes()
            if raw and not raw.endswith(b"\n"):
                with open(path, "r+b") as f:
                    f.truncate(raw.rfind(b"\n") + 1)
        self.metrics = open(path, "a", buffering=1)
        return self

    def event(self, rec: dict) -> None:
        """A record that is not an epoch (`{"event": ...}`: readers of epochs skip it)."""
        self.epoch(rec)

    def finish(self, result: dict, params=None) -> None:
        """``params``: (name, array) pairs to write as the model, in order (a pipelined run
        hands them over one stage at a time); default this rank's parameters."""
        self.metrics.close()
        worker = self.worker
        if not np.isfinite(worker.params).all():
            # Never hand out a NaN model: the newest checkpoint stays the last good state.
            self.log("warning: parameters are not finite; model.h5 was not written")
            self._write_summary(result)
            return
        tmp = self.dir / "model.h5.tmp"
        with h5py.File(tmp, "w") as f:
            pairs = worker.layout.views(worker.params).items() if params is None else params
            for name, arr in pairs:
                f.create_dataset(name, data=np.asarray(arr))
            f.attrs["graph_fingerprint"] = Graph.from_dict(self.spec.graph).fingerprint()  # the whole model's
            f.attrs["graph"] = json.dumps(self.spec.graph)
        os.replace(tmp, self.dir / names.MODEL)
        self._write_summary(result)

    def _write_summary(self, result: dict) -> None:
        summary = dict(result)
        summary["run_dir"] = str(self.dir)
        summary["lanes"] = self.lane_names
        watched = watchdog.current().stats()
        if watched is not None:
            summary["watchdog"] = watched
        with open(self.dir / f"{names.SUMMARY}.tmp", "w") as f:
            json.dump(summary, f, indent=1, default=_json_default)
        os.replace(self.dir / f"{names.SUMMARY}.tmp", self.dir / names.SUMMARY)
        if self.spec.report["plots"]:
            try:
                write_plots(self.dir)     # matplotlib loads here, on first use
            except ImportError:
                self.log("plots skipped: matplotlib is not installed (pip install 'hpc_rlx[report]')")
            except Exception as e:  # noqa: BLE001 - plots must never fail a finished run
                self.log(f"plots skipped: {type(e).__name__}: {e}")


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    return str(o)
