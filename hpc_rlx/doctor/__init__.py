"""`python -m hpc_rlx.doctor`: the preflight check. Each rank's local facts (`probe`), the
thread rule (`threads`), the training overrides it takes (`config`), and rank 0's analysis
and report (`check`)."""
