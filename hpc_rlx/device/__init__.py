"""Where the arithmetic runs: the array backends (NumPy, CuPy), the compute lanes of a rank,
the GPU-aware MPI paths, and the BLAS threads each rank may use. CuPy is imported only in
`backend`."""
