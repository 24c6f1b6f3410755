"""From the composed Hydra config to a TrainSpec, and where a run lives.

`spec` builds and checks the TrainSpec rank 0 ships; `hints` suggests keys for a mistyped
override; `fingerprint` says which training a run directory holds; `rundirs` picks the run
directory (and whether to resume); `segments` records each resumed segment's config. The YAML
groups themselves are in `hpc_rlx/configs/` (user-visible as `configs/`).
"""

from pathlib import Path

# The Hydra groups, inside the package so a plain (non-editable) install finds them
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
