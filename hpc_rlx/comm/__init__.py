"""Talking between ranks: agreed errors and guarded collectives (`collective`), the fused
bucket and its 16-bit wire (`wire`), aborting the job
(`job_abort`), and the stall watchdog with its authenticated UDP side channel (`watchdog`,
`heartbeat`, `side_channel`, `stall_report`)."""
