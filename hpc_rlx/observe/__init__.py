"""What a run shows and writes about itself: the run directory's files (`outputs`), the
progress bar or lines (`progress`; `launcher` decides which), rank 0's live view (`display`),
steps.jsonl and TensorBoard (`step_log`, `tensorboard_log`), the Chrome trace (`trace`), the
debug log (`debuglog`) and a sweep's summary (`sweep`). The reports read these files
afterwards (`hpc_rlx.report`)."""
