"""RMSNorm, with vLLM's fused residual add: `pallas_kernels.rms_norm` on the model's kernel
backend."""

from __future__ import annotations

from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp

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


class ShardedRMSNorm(nn.Module):
    """RMSNorm of rows that tensor parallelism splits over the devices of `tp_axis`, each
    holding an equal slice of every row and the matching slice of `weight` (OLMo 2's q and k
    norms span all heads; each device has its own heads). The mean of squares is the devices'
    mean of their slices' means: one all-reduce of a value per row. A KV head that several
    devices hold counts once per copy in the sum and in the width alike, so the mean is the
    model's. Without `tp_axis`: RMSNorm on the model's kernel backend."""

    eps: float
    dtype: Any
    backend: str
    tp_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if self.tp_axis is None:
            return cast(jax.Array, rms_norm(x, weight, self.eps, backend=self.backend))
        # The norm kernel takes its statistics from the row it holds, here a slice of one.
        xf = x.astype(jnp.float32)
        var = jax.lax.pmean(jnp.mean(xf * xf, axis=-1, keepdims=True), self.tp_axis)
        y = xf * jax.lax.rsqrt(var + self.eps) * weight.astype(jnp.float32)
        return y.astype(x.dtype)
