"""Linear layers: the weight matmul every projection runs, with its method chosen from the
model's settings (XLA's dot, the Pallas GEMV or dequant matmul kernels, a GGUF weight kept
quantized), and the row-parallel split of tensor parallelism.

Weights stay in PyTorch's [out, in] layout: checkpoints store it, and on CPU XLA streams it
faster than [in, out] at small T (each output is a dot over a contiguous row;
docs/perf/cpu-step.md), which is what decode is bound by. Column-parallel weights (the fused
q/k/v and gate/up) are laid out per device at load (distributed/tensor_parallel.py), so they
are plain `Linear`s here.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxllm.distributed.tensor_parallel import all_reduce
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, gguf_linear
from pallas_kernels.dequant_matmul import dequant_matmul
from pallas_kernels.skinny_matmul import skinny_matmul


def linear(x: jax.Array, weight: jax.Array | GGUFWeight, backend: str = "reference",
           gemv_rows: int = 0) -> jax.Array:
    """x [T, in] times weight [out, in] transposed (or a GGUF weight kept quantized:
    `gguf_linear` on XLA, the fused dequant matmul kernel with a Pallas `backend`). With a
    Pallas backend and T <= `gemv_rows`, a dense weight goes through the weight-streaming GEMV
    kernel (pallas_kernels/skinny_matmul.py) instead of XLA's dot."""
    if isinstance(weight, GGUFWeight):
        if backend != "reference":
            if weight.packed:
                raise ValueError(f"a GGUF weight packed in panels for the CPU kernel reaches the "
                                 f"{backend!r} kernel backend, which reads blocks as rows: load "
                                 f"the model with that kernel_backend")
            return dequant_matmul(x, weight.qweight, weight.scale, weight.offset,
                                  backend=backend)
        return gguf_linear(x, weight)
    if backend != "reference" and x.ndim == 2 and 1 <= x.shape[0] <= gemv_rows:
        return skinny_matmul(x, weight, backend=backend)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if weight.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        # A bfloat16 model on CPU keeps float32 activations (the runner's activation dtype):
        # only the GEMM's operands are bfloat16, accumulated and returned in float32.
        return jax.lax.dot_general(x.astype(jnp.bfloat16), weight, dims,
                                   preferred_element_type=jnp.float32)
    if weight.dtype != x.dtype:  # e.g. float32 weights under 16-bit (interpret-mode) activations
        return jax.lax.dot_general(x.astype(weight.dtype), weight, dims).astype(x.dtype)
    if x.dtype == jnp.bfloat16:
        # Accumulated and returned in float32: XLA on CPU runs a bf16 x bf16 -> f32 GEMM faster
        # than a float32 one, but converts both operands to float32 for a bf16 result
        # (docs/perf/gguf-cpu.md).
        return jax.lax.dot_general(x, weight, dims,
                                   preferred_element_type=jnp.float32).astype(x.dtype)
    return jax.lax.dot_general(x, weight, dims)


def weight_param(module: nn.Module, name: str, shape: tuple[int, ...], dtype: Any, init):
    """A weight param, or the GGUFWeight the params hold in its place (quantization="gguf");
    read without `param()`, whose shape check knows only plain arrays."""
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, GGUFWeight):
            return value
    return module.param(name, init, shape, dtype)


class Linear(nn.Module):
    """vLLM's Linear: params `weight` [out, in] and optional `bias` [out]."""

    features: int
    use_bias: bool
    dtype: Any
    backend: str = "reference"
    gemv_rows: int = 0  # see `linear`

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = weight_param(self, "weight", (self.features, x.shape[-1]), self.dtype,
                              nn.initializers.normal(0.02))
        y = linear(x, weight, self.backend, self.gemv_rows)
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
            # XLA on CPU fuses `dot + bias` into the dot, which then cannot take the
            # dequantization in and materialises the float32 weight; y - (-b) is bit-for-bit
            # y + b and is left alone.
            xla_gemv = isinstance(weight, GGUFWeight) and self.backend == "reference"
            y = y - (-bias) if xla_gemv else y + bias
        return y


class LinearDeferredBias(nn.Module):
    """`Linear` with a bias whose add is left to the kernel that reads the output next: returns
    (x W^T, bias), the params as Linear's."""

    features: int
    dtype: Any
    backend: str = "reference"
    gemv_rows: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        weight = weight_param(self, "weight", (self.features, x.shape[-1]), self.dtype,
                              nn.initializers.normal(0.02))
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return linear(x, weight, self.backend, self.gemv_rows), bias


class RowParallelLinear(nn.Module):
    """A `Linear` whose input features are split over `tp_axis` (o_proj, down_proj): each
    device multiplies its slice, one all-reduce sums them; the bias, whole on every device, is
    added once, after the sum."""

    features: int
    dtype: Any
    backend: str = "reference"
    gemv_rows: int = 0
    tp_axis: str | None = None
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = weight_param(self, "weight", (self.features, x.shape[-1]), self.dtype,
                              nn.initializers.normal(0.02))
        y = all_reduce(linear(x, weight, self.backend, self.gemv_rows), self.tp_axis)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y
