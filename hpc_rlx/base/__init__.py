"""What every layer uses, and which uses no other part of hpc_rlx: the errors users see
(`errors`), config value checks (`checks`), the run directory's file names (`run_dir_names`),
the array backends (`backend`; CuPy is imported only there), CUDA-aware MPI detection
(`cuda_mpi`), trace spans (`trace`), where ranks run (`topology`), even ranges of a vector
(`even_split`) and the package version (`version`)."""
