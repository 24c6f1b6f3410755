"""LARS (You, Gitman and Ginsburg, 2017, "Large Batch Training of Convolutional Networks",
Algorithm 1): SGD with momentum whose step is scaled per parameter by a trust ratio. The
variant, per parameter tensor, gradient g:

    ratio = eta * ||p|| / (||g|| + wd * ||p||),  or 1 where ||p|| = 0 or ||g|| = 0
    v = momentum * v + lr * ratio * (g + wd * p)
    p = p - v

- the learning rate enters the momentum (the paper's form, and the MLPerf ResNet-50
  reference's LARS); the momentum starts at zero; no Nesterov;
- weight decay: L2, added to the gradient after the trust ratio is computed, and in the
  ratio's denominator as ``wd * ||p||``; no epsilon;
- every parameter is adapted and decayed unless `optim.no_decay` names it: then it has neither
  weight decay nor adaptation (ratio 1), as the MLPerf reference exempts biases and
  normalization weights from both; `optim.lr_mult` scales a parameter's learning rate;
- no gradient clipping of its own (`optim.clip_grad_norm` clips before the step).

The norms are over each whole parameter: under `comm.shard=optimizer` the parts of a parameter
cut by a slice boundary are added across ranks (`Optimizer.segment_norms`).
"""

from __future__ import annotations

from hpc_rlx.base.errors import check_param
from hpc_rlx.optim.base import IN_UNIT, NONNEG, POSITIVE, Hyper, Optimizer, in_unit, nonneg


class LARS(Optimizer):
    """LARS with the learning rate inside the momentum and L2 weight decay in the ratio."""

    name = "lars"
    lr = 2.0
    steps_settings_itself = True
    hyper = (
        Hyper("momentum", 0.9, "momentum (the learning rate inside it)", IN_UNIT),
        Hyper("weight_decay", 0.0001, "L2 weight decay, also in the trust ratio's denominator", NONNEG),
        Hyper("trust_coefficient", 0.001, "eta, the trust ratio's coefficient", POSITIVE),
    )
    _array_names = ("momentum_buffer",)

    def __init__(self, size, xp, dtype, momentum=0.9, weight_decay=0.0001, trust_coefficient=0.001):
        super().__init__(size, xp, dtype)
        self.momentum = in_unit("momentum", momentum, "lars")
        self.weight_decay = nonneg("weight_decay", weight_decay, "lars")
        self.trust_coefficient = float(check_param(POSITIVE, "trust_coefficient", trust_coefficient, "lars"))
        self._momentum_buffer = self._zeros()
        self._scratch = self._zeros()

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """One step with the gradient ``grad_scale * grads``; ``grads`` may be overwritten. A
        collective under sharded state (the cut parameters' norms: `segment_norms`)."""
        xp, lr, scale, wd = self.xp, float(lr), float(grad_scale), self.weight_decay
        if scale != 1.0:
            grads *= scale
        norms = self.segment_norms(params, grads)
        d = grads
        if wd:                                      # d = g + wd * p
            d = self._scratch
            xp.multiply(params, wd, out=d)
            d += grads
        for k, (seg, (p_norm, g_norm)) in enumerate(zip(self.segments, norms)):
            setting = self.setting_of(k)
            part = d[seg.start:seg.stop]
            if not setting.decay:       # optim.no_decay: the plain gradient, a ratio of 1
                xp.copyto(part, grads[seg.start:seg.stop])
            adapt = setting.decay and p_norm > 0.0 and g_norm > 0.0
            ratio = self.trust_coefficient * p_norm / (g_norm + wd * p_norm) if adapt else 1.0
            part *= lr * setting.lr_mult * ratio
        v = self._momentum_buffer
        v *= self.momentum
        v += d
        params -= v
        self.step_count += 1
