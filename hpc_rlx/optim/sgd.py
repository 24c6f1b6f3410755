"""SGD with optional momentum (dampening 0), Nesterov and L2 weight decay, step for step as
``torch.optim.SGD``. On NumPy the update runs fused (BLAS scal/axpy, block by block: see
`base.blocks`), with the same bits as whole-array passes on one BLAS thread."""

from __future__ import annotations

import numpy as np

from hpc_rlx.base.checks import BOOL
from hpc_rlx.base.errors import ConfigError, check_param
from hpc_rlx.optim.base import IN_UNIT, NONNEG, Hyper, Optimizer, in_unit, nonneg
from hpc_rlx.optim.blas import axpy, fusable, scal


class SGD(Optimizer):
    """SGD with optional momentum (dampening 0), Nesterov and L2 weight decay, as torch.optim.SGD."""

    name = "sgd"
    lr = 0.1
    hyper = (
        Hyper("momentum", 0.9, "momentum (dampening 0)", IN_UNIT),
        Hyper("nesterov", False, "Nesterov momentum (needs momentum > 0)", BOOL, type=bool),
        Hyper("weight_decay", 0.0, "L2 weight decay, added to the gradient", NONNEG),
    )

    def __init__(self, size, xp, dtype, momentum=0.0, nesterov=False, weight_decay=0.0):
        super().__init__(size, xp, dtype)
        self.momentum = in_unit("momentum", momentum, "sgd")
        self.weight_decay = nonneg("weight_decay", weight_decay, "sgd")
        check_param(BOOL, "nesterov", nesterov, "sgd")
        if nesterov and self.momentum == 0.0:
            raise ConfigError.bad_param("nesterov", "=true needs momentum > 0, got momentum=0", "sgd")
        self.nesterov = nesterov
        self._array_names = ("momentum_buffer",) if self.momentum else ()
        if self.momentum:
            self._momentum_buffer = self._zeros()
        self._scratch = self._zeros()
        self._scratch2 = self._zeros() if nesterov else None

    def _step(self, params, grads, lr: float, grad_scale: float) -> None:
        """One step with the gradient ``grad_scale * grads`` (the runtime passes the summed
        gradient and 1 / samples: the mean is never written out as its own pass). ``grads``
        may be overwritten."""
        lr, scale = float(lr), float(grad_scale)
        if not self.nesterov and fusable(params, grads):
            self._fused_step(params, grads, lr, scale)
        else:
            if scale != 1.0:
                grads *= scale
            self._plain_step(params, grads, lr)
        self.step_count += 1

    def _fused_step(self, params, grads, lr: float, scale: float) -> None:
        """torch's update in BLAS passes: buf = m*buf + s*g + wd*p; p -= lr*buf (3-4 passes
        where NumPy needs 5-6 and a scratch array), block by block."""
        first = self.step_count == 0
        for lo, hi in self._ranges:
            self._fused_block(params[lo:hi], grads[lo:hi], lr, scale, first,
                              self._momentum_buffer[lo:hi] if self.momentum else None)

    def _fused_block(self, params, grads, lr: float, scale: float, first: bool, buf) -> None:
        if buf is None:
            if self.weight_decay:
                scal(1.0 - lr * self.weight_decay, params)
            axpy(-lr * scale, grads, params)
            return
        if first:
            # torch starts the buffer at the first gradient, not at zero
            np.multiply(grads, scale, out=buf)
        else:
            scal(self.momentum, buf)
            axpy(scale, grads, buf)
        if self.weight_decay:
            axpy(self.weight_decay, params, buf)
        axpy(-lr, buf, params)

    def _plain_step(self, params, grads, lr: float) -> None:
        xp = self.xp
        d = grads
        if self.weight_decay:
            d = self._scratch
            xp.multiply(params, self.weight_decay, out=d)
            d += grads
        if self.momentum:
            buf = self._momentum_buffer
            if self.step_count == 0:
                # torch starts the buffer at the first gradient, not at zero
                xp.copyto(buf, d)
            else:
                buf *= self.momentum
                buf += d
            if self.nesterov:
                xp.multiply(buf, self.momentum, out=self._scratch2)
                if d is grads:
                    xp.add(grads, self._scratch2, out=self._scratch)
                else:
                    self._scratch += self._scratch2
                d = self._scratch
            else:
                d = buf
        xp.multiply(d, lr, out=self._scratch)
        params -= self._scratch
