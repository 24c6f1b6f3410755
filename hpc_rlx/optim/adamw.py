"""Adam with decoupled weight decay and bias correction, step for step as ``torch.optim.AdamW``
(no amsgrad)."""

from __future__ import annotations

import math

import numpy as np

from hpc_rlx.base.errors import check_param
from hpc_rlx.optim.base import NONNEG, POSITIVE, Hyper, Optimizer, decay_pair, nonneg
from hpc_rlx.optim.blas import axpy, fusable, scal


class AdamW(Optimizer):
    """Adam with decoupled weight decay and bias correction, as torch.optim.AdamW (no amsgrad)."""

    name = "adamw"
    lr = 0.003
    hyper = (
        # checked by the class, whose message names the element (`optim.betas[1] must be ...`)
        Hyper("betas", [0.9, 0.999], "decay rates of the moment estimates", None, type=list, to_arg=tuple),
        Hyper("eps", 1e-8, "denominator term", POSITIVE),
        Hyper("weight_decay", 0.01, "decoupled weight decay", NONNEG),
    )
    _array_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, size, xp, dtype, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(size, xp, dtype)
        self.beta1, self.beta2 = decay_pair(betas, "adamw")
        self.eps = float(check_param(POSITIVE, "eps", eps, "adamw"))
        self.weight_decay = nonneg("weight_decay", weight_decay, "adamw")
        self._exp_avg = self._zeros()
        self._exp_avg_sq = self._zeros()
        self._scratch = self._zeros()

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """One step with the gradient ``grad_scale * grads``; ``grads`` may be overwritten."""
        lr, scale = float(lr), float(grad_scale)
        self.step_count += 1
        if fusable(params, grads):
            self._fused_step(params, grads, lr, scale)
        else:
            if scale != 1.0:
                grads *= scale
            self._plain_step(params, grads, lr)

    def _fused_step(self, params, grads, lr: float, scale: float) -> None:
        """torch's update in 10 in-place passes per block (BLAS scal/axpy, NumPy ufuncs with
        ``out=``) where the plain form takes 15 over whole arrays, the gradient scale folded
        into the coefficients:
            m = b1*m + (1-b1)*s*g;   v = b2*v + (1-b2)*s^2*g^2
            p -= (step_size*c2) * m / (sqrt(v) + eps*c2)     (c2 = sqrt of bias correction 2)
        the same value as torch's m / (sqrt(v)/c2 + eps) * step_size, rounded differently
        (a few ulp: tests/unit/runtime/test_lean_step.py)."""
        k = self.step_count
        c2 = math.sqrt(1.0 - self.beta2**k)
        decay = 1.0 - lr * self.weight_decay
        b1, b2, gm, gv = self.beta1, self.beta2, (1.0 - self.beta1) * scale, (1.0 - self.beta2) * scale * scale
        eps, a = self.eps * c2, -lr / (1.0 - self.beta1**k) * c2
        m_all, v_all, t_all = self._exp_avg, self._exp_avg_sq, self._scratch
        for lo, hi in self._ranges:
            p, g, m, v, t = params[lo:hi], grads[lo:hi], m_all[lo:hi], v_all[lo:hi], t_all[lo:hi]
            if self.weight_decay:
                scal(decay, p)
            scal(b1, m)
            axpy(gm, g, m)
            np.multiply(g, g, out=t)
            scal(b2, v)
            axpy(gv, t, v)
            np.sqrt(v, out=t)
            t += eps
            np.divide(m, t, out=t)
            axpy(a, t, p)

    def _plain_step(self, params, grads, lr: float) -> None:
        """torch's update op for op (any array module: CuPy arrays, strided views)."""
        xp = self.xp
        m, v, t = self._exp_avg, self._exp_avg_sq, self._scratch
        k = self.step_count
        if self.weight_decay:
            params *= 1.0 - lr * self.weight_decay
        # m <- lerp(m, g, 1 - beta1), in the same two-branch form torch uses, for equal rounding
        w = 1.0 - self.beta1
        xp.subtract(grads, m, out=t)
        if w < 0.5:
            t *= w
            m += t
        else:
            t *= 1.0 - w
            xp.subtract(grads, t, out=m)
        v *= self.beta2
        xp.multiply(grads, 1.0 - self.beta2, out=t)
        t *= grads
        v += t
        step_size = lr / (1.0 - self.beta1**k)
        bc2_sqrt = math.sqrt(1.0 - self.beta2**k)
        xp.sqrt(v, out=t)
        t /= bc2_sqrt
        t += self.eps
        xp.divide(m, t, out=t)
        t *= step_size
        params -= t
