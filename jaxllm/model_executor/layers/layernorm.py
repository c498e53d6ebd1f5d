"""RMSNorm, with vLLM's fused residual add: `pallas_kernels.rms_norm` on the model's kernel
backend."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from pallas_kernels.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """Param `weight` [hidden]. Called with a residual it returns (norm(x + residual),
    x + residual), the add riding along with the norm."""

    eps: float
    dtype: Any
    backend: str

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> Any:
        # Any: an array without a residual, a pair with one.
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, weight, self.eps, residual, backend=self.backend)
