"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", Algorithm 2): Adam's direction with decoupled weight decay, scaled per parameter by
a trust ratio. The variant, per parameter tensor, at step t (from 1), gradient g:

    m = b1 * m + (1 - b1) * g;          v = b2 * v + (1 - b2) * g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p
    ratio = ||p|| / ||u||,  or 1 where ||p|| = 0 or ||u|| = 0
    p = p - lr * ratio * u

- bias correction: yes (both moments);
- weight decay: decoupled, added to the Adam direction before the trust ratio's norm, so it
  enters ||u|| (apex's FusedLAMB with ``adam_w_mode=True``, as DeepCAM's reference trains);
- the ratio is the identity phi of the paper (no clamp), and applies to every parameter, also
  one whose weight decay is 0 (apex's ``use_nvlamb=True``; apex's default skips the ratio
  for a parameter group with weight decay 0); a parameter in `optim.no_decay` has neither weight
  decay nor a trust ratio (ratio 1: apex's default for such a group, TensorFlow's
  ``exclude_from_layer_adaptation``), and `optim.lr_mult` scales its learning rate;
- no gradient clipping of its own: `optim.clip_grad_norm` clips the global norm before the
  step as torch's ``clip_grad_norm_`` does (apex clips by ``max_grad_norm``, 1.0 unless set,
  with the coefficient ``max / max(norm, max)``: the same up to torch's 1e-6 in the denominator).

The norms are over each whole parameter: under `comm.shard=optimizer` the parts of a parameter
cut by a slice boundary are added across ranks (`Optimizer.segment_norms`).
"""

from __future__ import annotations

from hpc_rlx.base.errors import check_param
from hpc_rlx.optim.base import NONNEG, POSITIVE, Hyper, Optimizer, decay_pair, nonneg


class LAMB(Optimizer):
    """LAMB with bias correction and decoupled weight decay inside the trust ratio."""

    name = "lamb"
    lr = 0.01
    steps_settings_itself = True
    hyper = (
        Hyper("betas", [0.9, 0.999], "decay rates of the moment estimates", None, type=list, to_arg=tuple),
        Hyper("eps", 1e-6, "denominator term", POSITIVE),
        Hyper("weight_decay", 0.01, "decoupled weight decay, inside the trust ratio", NONNEG),
    )
    _array_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, size, xp, dtype, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(size, xp, dtype)
        self.beta1, self.beta2 = decay_pair(betas, "lamb")
        self.eps = float(check_param(POSITIVE, "eps", eps, "lamb"))
        self.weight_decay = nonneg("weight_decay", weight_decay, "lamb")
        self._exp_avg = self._zeros()
        self._exp_avg_sq = self._zeros()
        self._scratch = self._zeros()

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """One step with the gradient ``grad_scale * grads``; ``grads`` is overwritten. A
        collective under sharded state (the cut parameters' norms: `segment_norms`)."""
        xp, lr, scale = self.xp, float(lr), float(grad_scale)
        self.step_count += 1
        k = self.step_count
        m, v, u = self._exp_avg, self._exp_avg_sq, self._scratch
        if scale != 1.0:
            grads *= scale
        m *= self.beta1
        xp.multiply(grads, 1.0 - self.beta1, out=u)
        m += u
        v *= self.beta2
        xp.multiply(grads, grads, out=u)
        u *= 1.0 - self.beta2
        v += u
        # u = m_hat / (sqrt(v_hat) + eps), m_hat's division last (one scratch array)
        xp.divide(v, 1.0 - self.beta2**k, out=u)
        xp.sqrt(u, out=u)
        u += self.eps
        xp.divide(m, u, out=u)
        u /= 1.0 - self.beta1**k
        if self.weight_decay and self.settings is None:
            xp.multiply(params, self.weight_decay, out=grads)     # the gradient is spent
            u += grads
        elif self.weight_decay:         # optim.no_decay: only the decayed parameters
            for k, seg in enumerate(self.segments):
                if self.setting_of(k).decay:
                    a, b = seg.start, seg.stop
                    xp.multiply(params[a:b], self.weight_decay, out=grads[a:b])
                    u[a:b] += grads[a:b]
        for k, (seg, (p_norm, u_norm)) in enumerate(zip(self.segments, self.segment_norms(params, u))):
            setting = self.setting_of(k)
            # a parameter without weight decay keeps a ratio of 1 (optim/groups.py)
            adapt = setting.decay and p_norm > 0.0 and u_norm > 0.0
            part = u[seg.start:seg.stop]
            part *= lr * setting.lr_mult * (p_norm / u_norm if adapt else 1.0)
            params[seg.start:seg.stop] -= part
