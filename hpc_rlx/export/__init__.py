"""`python -m hpc_rlx.export RUN_DIR --onnx OUT.onnx --state-dict OUT.safetensors`: a run's
trained model for inference elsewhere.

- `trained`: the run directory's graph and parameter values (model.h5 or a checkpoint);
- `ir_to_onnx` + `onnx_ops` (one translation per IR op) + `onnx_writer`: a builder or
  hand-written graph as an inference ONNX model;
- `onnx_source`: a model imported from ONNX, written back into its original file with the
  trained weights, and its state dict under the original names;
- `safetensors_file`: the safetensors format in NumPy;
- `command`: the command line.

`onnx` is optional and imported only by an export that needs it.
"""
