"""Where the arithmetic can run: the BLAS threads each rank may use (`host_blas`, `threads`),
the plan of a rank's compute lanes over its devices (`lane_plan`) and the evaluation counts
(`eval_counts`). The array backends themselves are `hpc_rlx.base.backend`; the lanes that run
the graph are `hpc_rlx.runtime.lanes`."""
