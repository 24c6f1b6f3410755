"""Fault tolerance, in one place (`comm.on_failure`): what the mode means (`mode`), MPI's ULFM
calls (`ulfm`), the recovery's decisions (`plan`, pure), a rank dead before training
(`startup`), one dead during it (`in_run`), the typed failure `train` raises (`failure`), and
the hook a component offers when the ranks change (`hooks`)."""
