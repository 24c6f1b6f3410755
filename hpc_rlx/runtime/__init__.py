"""The training loop and what it holds: `train` (the loop: setup, epochs, validation,
checkpoints), `worker` (one rank's data, parameters, bucket, optimizer), `state` (the one
writer of step, epoch and position), `optim`, `signals` (SIGTERM/SIGUSR1/SIGINT to a stop at
the next step), `faults` (failures injected on purpose by debug.*) and `lanes` (the CPU and
GPU executors of a rank, fed by their measured throughput). Policies, which decide
how steps become synchronised parameters, are in `hpc_rlx.policies`."""
