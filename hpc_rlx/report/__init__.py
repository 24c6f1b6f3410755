"""`python -m hpc_rlx.report RUN_DIR|SWEEP_DIR`: a finished run's or sweep's text summary
(`text`) and plots (`plots`), from the files the run wrote (`data`)."""
