"""The names of what a run directory holds, in one place: the modules that write a file and
the ones that read it back (`observe/run_files.py`, the report, the exporter) name it from here.
Pure constants; any layer may import them. docs/observe.md describes each file."""

METRICS = "metrics.jsonl"           # one record per epoch, plus event records
STEPS = "steps.jsonl"               # one record per step
SUMMARY = "summary.json"            # the run's end: status, final metrics, per-rank figures
MODEL = "model.h5"                  # the trained parameters
GRAPH = "graph.json"                # the model graph the run trained
CONFIG = "config.yaml"              # the composed config (a resume's segments: config.segment-K.yaml)
OVERRIDES = "overrides.txt"         # a sweep point's command-line overrides
RUN_LOG = "hpc_rlx.log"             # what rank 0 printed
TRACE = "trace.json"                # the Chrome trace (trace.enabled=true)
SWEEP_SUMMARY = "sweep_summary.md"  # a sweep directory's table of its points
CHECKPOINTS = "checkpoints"         # the checkpoint folder
LOCK = ".hpc_rlx.lock"              # held while a run writes the directory
PLOTS = "plots"                     # report.plots=true
TENSORBOARD = "tensorboard"         # report.tensorboard
