"""GGUF weights kept quantized on the device (vLLM's `quantization="gguf"`), XLA on CPU.

A weight is a `GGUFWeight`: int8 values [out, in] and one float32 scale (and offset) per block
of 16 or 32 values along `in` (model_loader/gguf_repack.py), whose dequantization
`q * scale + offset` is bit-for-bit what `gguf` dequantizes the file's blocks to.

On CPU the matmul is our fused dequant kernel (cpu_dequant_matmul.py: the int8 weight, packed in
its panel layout at load (with gguf_compact, 4- and 5-bit values in 5-bit panels), read once per
block of 64 rows in any bucket, each block's scale applied to its partial sums). Where that
cannot be built it is a GEMV per row, `x[i] @ dequantize(w).T`: XLA's CPU backend fuses the
dequantization into a matrix-vector dot (each weight element formed in registers from its int8
value, the weight read once per row), under three conditions found by reading its compiled HLO:
  - the vector is under 16 KiB (`kFusionThresholdBytes` in XLA's cpu_instruction_fusion.cc):
    wider rows (down_proj's 4864) are cut into chunks of whole blocks, whose partial GEMVs add up;
  - the dot's result is not fed straight into an add, which XLA fuses into the dot first (then
    materialising the float32 weight): partial sums and biases are combined as `a - (-b)`,
    bit-for-bit `a + b` in IEEE arithmetic, which it leaves alone;
  - the vector-matrix form `x[i] @ w.T` (a dot_general of [1, in] by [out, in] is not fused).
Otherwise XLA materialises the whole float32 weight every call, several times slower than the
float32 GEMV (docs/perf/gguf-cpu.md), as it does for any multi-row dot of a converted weight.
The weight values inside the dot are exactly the float32 path's; the summation order is that of
XLA's fused dot emitter (and of the chunks) rather than of the float32 GEMV, and each row's
result is the same whatever the other rows are (tests/model/test_gguf_quant.py checks both, and
that a compiled decode step materialises no dequantized weight).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul

# XLA fuses a producer into a matrix-vector dot only below this many vector bytes.
_XLA_CPU_GEMV_FUSION_BYTES = 16 * 1024


class GGUFWeight(NamedTuple):
    """A GGUF tensor kept quantized: a pytree, so it travels in the params like an array. Either
    rows ([out, in] int8, per-block scale/offset [out, in // block]: XLA's GEMVs and the Pallas
    kernel read these) or, for our CPU kernel, its panels (`cpu_dequant_matmul.pack`: [out / P,
    in, P] and [out / P, in // block, P]); the values are the same."""

    # int8 [out, in]; packed int8 [out / P, in, P] or uint8 [out / 64, in, 40]; for the integer
    # path uint8 or int8 [out / P, in / 4, P, 4] or nibble-packed [out / 64, in / 4, 128..192]
    qweight: jax.Array
    # float32 [out, in // block], or [out / P, in // block, P] packed (float16 for the integer path)
    scale: jax.Array
    offset: jax.Array | None  # as scale; None when the format has no mins

    @property
    def packed(self) -> bool:
        return self.qweight.ndim >= 3

    @property
    def shape(self) -> tuple[int, int]:
        if self.packed:  # the scales' panels give P (a 5-bit panel's values are 40 bytes wide)
            panels, _, p = self.scale.shape
            groups = self.qweight.shape[1]
            return panels * p, groups * (cpu_dequant_matmul.INT8_GROUP if self.int8 else 1)
        rows, cols = self.qweight.shape
        return rows, cols

    @property
    def int8(self) -> bool:
        """Packed for the integer path (`cpu_dequant_matmul.pack_int8`, cpu_int8_activations)."""
        return cpu_dequant_matmul.is_int8(self.qweight)

    @property
    def block_size(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self))


def dequantize(w: GGUFWeight, rows: jax.Array | None = None) -> jax.Array:
    """float32 [out, in] (or just `rows` of it, for an embedding gather): exactly gguf's values,
    but for the integer path's layout, whose scales are float16."""
    qweight, scale, offset = w.qweight, w.scale, w.offset
    if rows is None and w.packed:
        qweight, scale = cpu_dequant_matmul.unpack(qweight), cpu_dequant_matmul.unpack(scale)
        offset = None if offset is None else cpu_dequant_matmul.unpack(offset)
    elif rows is not None and w.packed:
        take = cpu_dequant_matmul.take_rows
        qweight, scale = take(qweight, rows), take(scale, rows)
        offset = None if offset is None else take(offset, rows)
    elif rows is not None:
        qweight, scale = jnp.take(qweight, rows, axis=0), jnp.take(scale, rows, axis=0)
        offset = None if offset is None else jnp.take(offset, rows, axis=0)
    n, cols = qweight.shape
    deq = qweight.reshape(n, -1, w.block_size).astype(jnp.float32) * scale[..., None]
    if offset is not None:
        deq = deq + offset[..., None]
    return deq.reshape(n, cols)


def single_chunk(in_features: int) -> bool:
    """Whether rows this wide fit one fused XLA GEMV (matters without our CPU kernel only).
    Wider ones (down_proj, 4864) work in chunks but lost to the float32 GEMV on CPU
    (docs/perf/gguf-cpu.md), so the loader then keeps them float32 in the GEMV tree."""
    return in_features * 4 < _XLA_CPU_GEMV_FUSION_BYTES


def gemv_chunks(in_features: int, block_size: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of whole blocks, each under XLA's GEMV fusion limit, covering `in`."""
    limit = (_XLA_CPU_GEMV_FUSION_BYTES // 4 - 1) // block_size * block_size
    count = -(-in_features // limit)
    size = -(-in_features // count // block_size) * block_size
    return [(a, min(a + size, in_features)) for a in range(0, in_features, size)]


def _gemv(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """x [in] times the dequantized weight, chunked along `in` as XLA needs (module docstring)."""
    y = None
    for a, b in gemv_chunks(w.qweight.shape[1], w.block_size):
        ba, bb = a // w.block_size, -(-b // w.block_size)
        part = GGUFWeight(w.qweight[:, a:b], w.scale[:, ba:bb],
                          None if w.offset is None else w.offset[:, ba:bb])
        p = x[a:b] @ dequantize(part).T
        y = p if y is None else y - (-p)
    assert y is not None, "gemv_chunks covers at least one block"
    return y


def use_cpu_kernel() -> bool:
    """Whether quantized matmuls run our CPU kernel (cpu_dequant_matmul.py) rather than XLA's
    fused GEMVs: on the CPU backend, where it could be built."""
    return jax.default_backend() == "cpu" and cpu_dequant_matmul.available()


def gguf_linear(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """x [T, in] times the dequantized weight [out, in] transposed -> [T, out] float32.

    A packed weight (the loader packs them where our CPU kernel runs) goes to that kernel,
    which reads the int8 weight once for all T rows. Otherwise one fused XLA GEMV per row:
    reads the int8 weight T times, which beats the float32 GEMM only for a few rows; the runner
    then gives GGUFWeights to small decode buckets only. The vector-matrix form `x[i] @ w.T` is
    the one XLA fuses (a dot_general of [1, in] by [out, in] is not)."""
    if w.int8:
        return cpu_dequant_matmul.int8_matmul(x, w.qweight, w.scale, w.offset)
    if w.packed:
        return cpu_dequant_matmul.dequant_matmul(x, w.qweight, w.scale, w.offset)
    return jnp.stack([_gemv(x[i].astype(jnp.float32), w) for i in range(x.shape[0])])
