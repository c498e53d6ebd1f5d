"""The CPU fused dequant matmul (cpu_dequant_matmul.cc), an XLA FFI custom call, built and
registered by cpu_ffi.py. Where it cannot be built (no compiler: a warning) or
`JAXLLM_CPU_KERNELS=0`, `available()` is False: a .gguf model then loads dequantized by default,
and an explicit quantization="gguf" runs XLA's fused GEMVs instead (gguf.py; slower).

Why a kernel of our own: XLA's CPU backend fuses an int8 weight's dequantization only into a
single-row GEMV under 16 KiB of vector, so it read the weights once per row and left down_proj
(rows of 4864) in float32; this kernel reads each quantized weight once per call for any number
of rows (the runner gives it the decode buckets up to GGUF_GEMV_MAX_ROWS).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.model_executor.layers import cpu_ffi

SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "jaxllm_dequant_matmul"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (decided once per process); False with a
    warning when it cannot be built, silently when $JAXLLM_CPU_KERNELS=0."""
    return cpu_ffi.register(SOURCE, {_TARGET: "JaxllmDequantMatmul"},
                            ".gguf models load dequantized by default, and quantization='gguf' "
                            "runs XLA's fused GEMVs (slower)")


def check_inputs(x: Any, qweight: Any, scale: Any, offset: Any | None) -> None:
    """ValueError naming the problem unless the operands have the shapes and dtypes the kernel
    reads: it indexes its buffers by these shapes with no bounds checks of its own per block."""
    shapes = {"x": x.shape, "qweight": qweight.shape, "scale": scale.shape}
    if offset is not None:
        shapes["offset"] = offset.shape
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"dequant_matmul: x [T, in], qweight [out, in], scale and offset "
                             f"[out, in // block] must be 2-D; {name} has shape {tuple(shape)}")
    if jnp.dtype(qweight.dtype) != jnp.int8:
        raise ValueError(f"dequant_matmul: qweight must be int8, got {qweight.dtype}")
    for name, arr in (("scale", scale), ("offset", offset)):
        if arr is not None and jnp.dtype(arr.dtype) != jnp.float32:
            raise ValueError(f"dequant_matmul: {name} must be float32, got {arr.dtype}")
    (out, cols), (srows, blocks) = qweight.shape, scale.shape
    if x.shape[1] != cols:
        raise ValueError(f"dequant_matmul: x [T, in] has in={x.shape[1]}, qweight [out, in] "
                         f"has in={cols}")
    if cols % 32:
        raise ValueError(f"dequant_matmul: in ({cols}) must be a multiple of 32")
    if srows != out or blocks == 0 or cols % blocks or cols // blocks not in (16, 32):
        raise ValueError(f"dequant_matmul: scale {tuple(scale.shape)} must be [out, in // block] "
                         f"with a block of 16 or 32 values for qweight {tuple(qweight.shape)}")
    if offset is not None and tuple(offset.shape) != tuple(scale.shape):
        raise ValueError(f"dequant_matmul: offset {tuple(offset.shape)} must have scale's shape "
                         f"{tuple(scale.shape)}")


def dequant_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                   offset: jax.Array | None) -> jax.Array:
    """x [T, in] times the dequantized weight [out, in] transposed -> [T, out] float32, reading
    the int8 weight once. Needs `available()`; blocks of 16 or 32 values, `in` a multiple of 32
    (every Qwen2 shape); other operands raise ValueError (check_inputs)."""
    check_inputs(x, qweight, scale, offset)
    if not available():
        raise RuntimeError("the CPU dequant matmul kernel is not available (see the warning)")
    t, n = x.shape[0], qweight.shape[0]
    has_offset = offset is not None
    if offset is None:
        offset = jnp.zeros((0,), jnp.float32)  # the FFI signature wants a buffer
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((t, n), jnp.float32))
    return call(x.astype(jnp.float32), qweight, scale, offset, has_offset=has_offset)
