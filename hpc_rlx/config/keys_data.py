"""The `data.*` keys (see `config/schema.py` for what a declaration is)."""

from __future__ import annotations

from hpc_rlx.base.checks import Check, OneOf, is_number
from hpc_rlx.config.key import DATASETS, Key, Options, every, selector

DISTRIBUTIONS = ("read", "scatter")
CACHES = ("memory", "stream")
_PREPARED = Options(digits="digits", synthetic="synthetic", text="text", file=None)
_NUMBER = (int, float)
_DATASET = Check(lambda v: isinstance(v, str) and v != "", "must be a dataset name")
_PATH = Check(lambda v: v is None or (isinstance(v, str) and v != ""), "must be a directory or null")

DATA_KEYS: tuple[Key, ...] = (
    selector("data", "name", DATASETS),
    Key("data.path", str, Options(digits="data/digits.h5", synthetic="data/synthetic.h5",
                                  text="data/text.h5", file="???"), "the training data: an HDF5 file, a "
                                  "directory of them or a glob pattern"),
    Key("data.prepare", str, _PREPARED, "dataset to prepare when the group's own default `data.path` "
        "is missing (another missing path is an error); null = never"),
    Key("data.one_sample_per_file", bool, every(DATASETS, False), "each file of `path` holds one "
        "sample, without a sample axis (DeepCAM's and CosmoFlow's layout); else each file's first "
        "axis is its samples"),
    Key("data.x", (str, list), every(DATASETS, "x"), "input dataset name (a path inside the file: "
        "`climate/data`), or a list of them for a model with several inputs (`[input_ids,attention_mask]`: "
        "docs/pytorch.md)", Check(lambda v: _DATASET.test(v) or (isinstance(v, list) and bool(v) and all(
            _DATASET.test(n) for n in v)), "must be a dataset name or a list of them")),
    Key("data.y", str, every(DATASETS, "y"), "label dataset name", _DATASET),
    Key("data.val_path", str, every(DATASETS, None), "a separate validation file (same dataset names)"),
    Key("data.val_fraction", _NUMBER, Options(digits=0.2, synthetic=0.2, text=0.1, file=0.2),
        "without `val_path`: the tail fraction of `path` used for validation",
        Check(lambda v: v is None or (is_number(v) and 0 <= v < 1), "must be in [0, 1)")),
    Key("data.distribution", str, every(DATASETS, "read"), "`read` (each rank reads its own "
        "hyperslab) or `scatter` (rank 0 reads and sends)", OneOf(*DISTRIBUTIONS)),
    Key("data.cache", str, every(DATASETS, "memory"), "`memory` (each rank holds its shard) or "
        "`stream` (a background thread reads the next steps' rows into a bounded ring of buffers; "
        "bitwise the same training)", OneOf(*CACHES)),
    Key("data.leftover", str, every(DATASETS, "drop"), "`drop` or `partial` (sample-weighted partial "
        "batches)"),
    Key("data.shuffle", bool, every(DATASETS, True), "per-epoch seeded shuffling"),
    Key("data.check_finite", bool, every(DATASETS, False), "refuse inputs with NaN/Inf at load time"),
    Key("data.stage_dir", str, every(DATASETS, None), "node-local directory (`$TMPDIR`, `/dev/shm`; "
        "variables expanded on each node) to copy each node's files to before the first step; "
        "null = read in place", _PATH),
    Key("data.stage_keep", bool, every(DATASETS, False), "keep the staged copies after the run "
        "(else removed at its end, also when it fails)"),
)
