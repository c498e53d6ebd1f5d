"""GGUF weights kept quantized on the device (vLLM's `quantization="gguf"`), XLA on CPU.

A weight is a `GGUFWeight`: int8 values [out, in] and one float32 scale (and offset) per block
of 16 or 32 values along `in` (model_loader/gguf_repack.py), whose dequantization
`q * scale + offset` is bit-for-bit what `gguf` dequantizes the file's blocks to.

The matmul is a GEMV per row, `x[i] @ dequantize(w).T`: XLA's CPU backend fuses the
dequantization into a matrix-vector dot (each weight element formed in registers from its int8
value, the weight read once per row), but only while the vector is under 16 KiB
(`kFusionThresholdBytes` in XLA's cpu_instruction_fusion.cc), i.e. `in` < 4096 float32 values.
Past that, or when the converted weight feeds a multi-row dot, XLA materialises the whole float32
weight every call (measured on a [9728, 896] weight: 13-17 ms against 1.2 ms for the float32
GEMV). The weight values inside the dot are exactly the float32 path's; the summation order is
that of XLA's fused dot emitter rather than of the float32 GEMV, and each row's result is the
same whatever the other rows are (tests/test_gguf_quant.py checks both).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# XLA fuses a producer into a matrix-vector dot only below this many vector bytes.
_XLA_CPU_GEMV_FUSION_BYTES = 16 * 1024


class GGUFWeight(NamedTuple):
    """A GGUF tensor kept quantized: a pytree, so it travels in the params like an array."""

    qweight: jax.Array  # int8 [out, in]
    scale: jax.Array  # float32 [out, in // block]
    offset: jax.Array | None  # float32 [out, in // block]; None when the format has no mins

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def block_size(self) -> int:
        return self.qweight.shape[-1] // self.scale.shape[-1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def dequantize(w: GGUFWeight, rows: jax.Array | None = None) -> jax.Array:
    """float32 [out, in] (or just `rows` of it, for an embedding gather), exactly gguf's values."""
    q, scale, offset = w.qweight, w.scale, w.offset
    if rows is not None:
        q, scale = jnp.take(q, rows, axis=0), jnp.take(scale, rows, axis=0)
        offset = None if offset is None else jnp.take(offset, rows, axis=0)
    n, cols = q.shape
    deq = q.reshape(n, -1, w.block_size).astype(jnp.float32) * scale[..., None]
    if offset is not None:
        deq = deq + offset[..., None]
    return deq.reshape(n, cols)


def fuses_as_gemv(in_features: int) -> bool:
    """Whether XLA on CPU streams this weight quantized in a GEMV (see the module docstring)."""
    return in_features * 4 < _XLA_CPU_GEMV_FUSION_BYTES


def gguf_linear(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """x [T, in] times the dequantized weight [out, in] transposed -> [T, out] float32.

    One fused GEMV per row: reads the int8 weight T times, which beats the float32 GEMM only for
    a few rows; the runner gives GGUFWeights to small decode buckets only. The vector-matrix
    form `x[i] @ w.T` is the one XLA fuses (a dot_general of [1, in] by [out, in] is not)."""
    rows = [x[i].astype(jnp.float32) @ dequantize(w).T for i in range(x.shape[0])]
    return jnp.stack(rows)
