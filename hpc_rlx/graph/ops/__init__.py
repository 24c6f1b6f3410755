"""The built-in ops, one module per concept, each op's type rule and forward (``defop``) beside
its VJP (``defvjp``). Importing this package registers them all; ``ir`` does, once.

``forward(xp, args, attrs, ctx) -> (out, saved)`` is written once against the array module
``xp``: ``saved`` carries what the VJP needs beyond the arguments and the output (masks,
softmax probabilities, im2col columns, shapes) and is only computed when ``ctx.need_saved`` is
set, so evaluation stays lean. Forwards never modify their arguments: an output may alias an
input (reshape, transpose, dropout off), never the reverse. Scalar constants are Python
floats, which keep float32 arrays float32.

``fn(xp, g, args, ans, saved, attrs, out) -> array`` returns the cotangent of one argument
given the cotangent ``g`` of the op's output. ``out`` is None or a preallocated array shaped
like that argument (a parameter's gradient view): GEMM-shaped rules write straight into it.
Rules never modify ``g`` or ``args`` (they may be shared); the executor copies the result into
``out`` when a rule ignores it. ``common.unbroadcast`` is the single place broadcasting is
undone.
"""

from hpc_rlx.graph.ops import activation  # noqa: F401  (each import registers its module's ops)
from hpc_rlx.graph.ops import attention  # noqa: F401
from hpc_rlx.graph.ops import conv  # noqa: F401
from hpc_rlx.graph.ops import conv_transpose  # noqa: F401
from hpc_rlx.graph.ops import dropout  # noqa: F401
from hpc_rlx.graph.ops import dtype  # noqa: F401
from hpc_rlx.graph.ops import elementwise  # noqa: F401
from hpc_rlx.graph.ops import embedding  # noqa: F401
from hpc_rlx.graph.ops import index  # noqa: F401
from hpc_rlx.graph.ops import linear  # noqa: F401
from hpc_rlx.graph.ops import loss  # noqa: F401
from hpc_rlx.graph.ops import masks  # noqa: F401
from hpc_rlx.graph.ops import norm  # noqa: F401
from hpc_rlx.graph.ops import pool  # noqa: F401
from hpc_rlx.graph.ops import random  # noqa: F401
from hpc_rlx.graph.ops import recurrent  # noqa: F401
from hpc_rlx.graph.ops import reduce  # noqa: F401
from hpc_rlx.graph.ops import resample  # noqa: F401
from hpc_rlx.graph.ops import shape  # noqa: F401
