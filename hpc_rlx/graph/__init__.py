"""The graph engine: a shippable model IR, its ops and VJPs, and an executor on NumPy or CuPy.

No MPI, HDF5 or Hydra in here; ``hpc_rlx.base.backend`` picks the array module.

    g = build_model("mlp", input_shape=(64,), num_classes=10, hidden=[128])
    layout = ParamLayout(g)
    params, grads = numpy.empty(layout.size, "float32"), numpy.empty(layout.size, "float32")
    init_params(g, params, seed=0)
    ex = Executor(g, numpy, "float32")
    out = ex.forward_backward(layout.views(params), layout.views(grads), {"x": xb, "y": yb}, seed=step)
"""

from hpc_rlx.graph.builder import GraphBuilder
from hpc_rlx.graph.executor import Executor
from hpc_rlx.graph.frozen import freeze_params
from hpc_rlx.graph.ir import SCHEMA_VERSION, Graph, InputSpec, Node, ParamSpec
from hpc_rlx.graph.models import BUILDERS, build_model, cnn, mlp, transformer_lm
from hpc_rlx.graph.param_names import trainable_user_names
from hpc_rlx.graph.params import INIT_SCHEMES, ParamLayout, init_params
from hpc_rlx.graph.registry import OPS, defvjp, register_op, unregister_op

__all__ = [
    "trainable_user_names",
    "freeze_params",
    "BUILDERS",
    "Executor",
    "Graph",
    "GraphBuilder",
    "INIT_SCHEMES",
    "InputSpec",
    "Node",
    "OPS",
    "ParamLayout",
    "ParamSpec",
    "SCHEMA_VERSION",
    "build_model",
    "cnn",
    "defvjp",
    "init_params",
    "mlp",
    "register_op",
    "transformer_lm",
    "unregister_op",
]
