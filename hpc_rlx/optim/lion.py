"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an
interpolation of momentum and gradient, with decoupled weight decay.

    c = sign(b1 * m + (1 - b1) * g)
    p = p * (1 - lr * wd) - lr * c
    m = b2 * m + (1 - b2) * g

One state array (the momentum m), so it holds half of AdamW's optimizer state. Every update
has the same size, lr, per element: the paper advises a learning rate 3-10x smaller than
AdamW's and a weight decay 3-10x larger, hence this config's defaults.
"""

from __future__ import annotations

from hpc_rlx.optim.base import NONNEG, Hyper, Optimizer, decay_pair, nonneg


class Lion(Optimizer):
    """Lion, evaluated in the order of the formula above on any array module."""

    name = "lion"
    lr = 0.0003
    hyper = (
        Hyper("betas", [0.9, 0.99], "interpolation (b1) and momentum decay (b2) rates", None,
              type=list, to_arg=tuple),
        Hyper("weight_decay", 0.1, "decoupled weight decay", NONNEG),
    )
    _array_names = ("exp_avg",)

    def __init__(self, size, xp, dtype, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(size, xp, dtype)
        self.beta1, self.beta2 = decay_pair(betas, "lion")
        self.weight_decay = nonneg("weight_decay", weight_decay, "lion")
        self._exp_avg = self._zeros()
        self._scratch = self._zeros()

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """One step with the gradient ``grad_scale * grads``; ``grads`` is overwritten."""
        xp, lr = self.xp, float(lr)
        m, g, c = self._exp_avg, self._scratch, grads
        xp.multiply(grads, float(grad_scale), out=g)
        # c = b1*m + (1-b1)*g, written as m + (1-b1)*(g - m) into the gradient's own array
        xp.subtract(g, m, out=c)
        c *= 1.0 - self.beta1
        c += m
        xp.sign(c, out=c)
        if self.weight_decay:
            params *= 1.0 - lr * self.weight_decay
        c *= lr
        params -= c
        m *= self.beta2
        g *= 1.0 - self.beta2
        m += g
        self.step_count += 1
