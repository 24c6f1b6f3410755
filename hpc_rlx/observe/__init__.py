"""What a run shows and writes about itself: the run directory's files (`outputs`), the
progress bar or lines (`progress`; `launcher` decides which), rank 0's live view (`display`),
steps.jsonl and TensorBoard (`step_log`, `tensorboard_log`), the Chrome trace (its spans are
`hpc_rlx.base.trace`), the
debug log (`debuglog`), a sweep's summary (`sweep`) and the lock that keeps a second job out
of a run directory (`run_lock`). The reports read these files
afterwards (`hpc_rlx.report`)."""
