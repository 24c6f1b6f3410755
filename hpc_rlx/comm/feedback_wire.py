"""The outer syncs' compressed wire (``policy.outer_wire_dtype``): `reduce.WireSum`'s owner
scheme with error feedback.

Each rank codes its slice of every owner's segment, and each owner codes the sum of its
segment once more (`reduce.WireSum`). Both codings round. Here neither loss is dropped: what a
rank's coding of its values lost is added to that rank's values at the next sync
(`sent_residual`), and what an owner's coding of a sum lost is added to that owner's next sum
of the same segment (`sum_residual`). Over syncs, everything a rank meant to send arrives; each
sync's error stays one coding step, instead of building up (error feedback, as in 1-bit SGD,
Streaming DiLoCo's 4-bit outer gradients and SparseLoCo).

The residuals are per rank, in the units of the sum (a rank's work-weighted values): they are
what a bitwise-exact resume needs (`state_dict`), and they depend on the world size (which rank
owns which segment), so a resume on another world size starts them from zero.

Every step is a deterministic function of the values, so every run repeats bitwise.
"""

from __future__ import annotations

import numpy as np

from hpc_rlx.comm.reduce import HostSum, OrderedSum, WireSum


class FeedbackWireSum(WireSum):
    """`WireSum` whose two codings carry what they round away to the next sync."""

    name = ""            # not a ``comm.reduction`` choice: the windowed policies build it
    keeps_state_by_index = True     # its residuals: a fragment's sum sets `offset`
    offset = 0           # where the summed array starts in the parameters (a fragment's start)

    def __init__(self, codec, chunk_elems: int, n_payload: int, dtype, deterministic: bool,
                 where: str = "host"):
        single_rank = (OrderedSum if deterministic else HostSum)(chunk_elems)
        super().__init__(codec, chunk_elems, single_rank, where)
        self.path = f"{where}, outer wire {codec.name}"
        self.sent_residual = np.zeros(int(n_payload), dtype)
        self.sum_residual = np.zeros(int(n_payload), dtype)

    def code_input(self, payload, a: int, b: int, out) -> None:
        o = self.offset
        self._code(payload[a:b], self.sent_residual[o + a:o + b], out)

    def code_sum(self, total, a: int, b: int, out) -> None:
        # the owner's float32 sum, widened to the residual's dtype so that adding the carried
        # error rounds nothing away that the residual would not see
        o = self.offset
        self._code(total.astype(self.sum_residual.dtype), self.sum_residual[o + a:o + b], out)

    def _code(self, values, residual, out) -> None:
        """Code ``values + residual`` (in place in ``values``) into ``out``; ``residual`` becomes
        what the coding dropped."""
        values += residual                # what the last syncs did not send
        self.codec.encode(values, out)
        np.subtract(values, self.codec.decode(out, values.size), out=residual)

    def drop_residuals(self) -> None:
        """Forget the carried errors (a resume on another world size: the segments moved)."""
        self.sent_residual.fill(0)
        self.sum_residual.fill(0)

    def state_dict(self) -> dict:
        return {"sent_residual": self.sent_residual.copy(), "sum_residual": self.sum_residual.copy()}

    def load_state_dict(self, state: dict) -> None:
        for key in ("sent_residual", "sum_residual"):
            src = np.asarray(state[key])
            dst = getattr(self, key)
            if src.shape != dst.shape:
                raise ValueError(f"outer wire residual '{key}' has shape {src.shape}, the model "
                                 f"needs {dst.shape}")
            dst[...] = src
