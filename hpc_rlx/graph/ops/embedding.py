"""``embedding``: rows of a table picked by integer ids (conventions in ``hpc_rlx.graph.ops``)."""

from __future__ import annotations

from hpc_rlx.base import backend
from hpc_rlx.graph.registry import defop, defvjp
from hpc_rlx.graph.shapes import FLOAT, TensorType, require_float, require_int, require_ndim


def _embedding_type(types, a):
    ids, table = types
    require_int(ids, "ids")
    require_float(table, "table")
    require_ndim(table, 2, "table (vocab, dim)")
    return TensorType(ids.shape + (table.shape[1],), FLOAT)


@defop("embedding", _embedding_type, (2, 2), arg_names=("ids", "table"))
def embedding(xp, args, a, ctx):
    ids, table = args
    return table[ids], None


def _embedding_table(xp, g, args, ans, s, a, out):
    ids, table = args
    dest = out if out is not None else xp.empty(table.shape, dtype=g.dtype)
    dest[...] = 0
    backend.scatter_add(xp, dest, ids.reshape(-1), g.reshape(-1, table.shape[1]))
    return dest


defvjp("embedding", None, _embedding_table)
