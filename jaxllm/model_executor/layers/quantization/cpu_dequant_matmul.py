"""The CPU fused dequant matmul (cpu_dequant_matmul.cc), an XLA FFI custom call, built and
registered by cpu_ffi.py, and the panel layout it reads (`pack`). Where it cannot be built (no
compiler: a warning) or `JAXLLM_CPU_KERNELS=0`, `available()` is False: a .gguf model then loads
dequantized by default, and an explicit quantization="gguf" runs XLA's fused GEMVs instead
(gguf.py; slower).

Why a kernel of our own: XLA's CPU backend fuses an int8 weight's dequantization only into a
single-row GEMV under 16 KiB of vector, so it read the weights once per row and left down_proj
(rows of 4864) in float32, and any multi-row dot of a converted weight materialised it in
float32. This kernel reads each quantized weight once per call (per block of 64 rows) and runs
at the float32 GEMM's rate from a few rows on, so every step of the engine (decode, prefill,
prompt logprobs) runs on the quantized weights and no float32 copy of them is kept.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


PANEL_SIZES = (64, 32, 16)  # output features per panel, the largest that divides `out`


def panel_size(out_features: int) -> int | None:
    """The panel width `pack` uses for a weight of `out_features` rows; None when no width
    divides it (such a weight stays float32)."""
    return next((p for p in PANEL_SIZES if out_features % p == 0), None)


def pack(qweight: np.ndarray, scale: np.ndarray, offset: np.ndarray | None
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The kernel's layout of a repacked GGUF weight (int8 [out, in], per-block scale/offset
    [out, in // block]): panels of P output features, k-major inside, q [out / P, in, P] and
    scale/offset [out / P, in // block, P] (cpu_dequant_matmul.cc says why). The same values,
    moved."""
    out = qweight.shape[0]
    p = panel_size(out)
    if p is None:
        raise ValueError(f"dequant_matmul: out ({out}) must be a multiple of 16")

    def panels(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(out // p, p, a.shape[1]).transpose(0, 2, 1))

    return panels(qweight), panels(scale), None if offset is None else panels(offset)


def unpack(a: Any) -> Any:
    """[out / P, cols, P] -> [out, cols]: `pack`'s inverse for one array (numpy or jax)."""
    panels, cols, p = a.shape
    return a.transpose(0, 2, 1).reshape(panels * p, cols)


def check_inputs(x: Any, qweight: Any, scale: Any, offset: Any | None) -> None:
    """ValueError naming the problem unless the operands have the shapes and dtypes the kernel
    reads (`pack`'s layout): it indexes its buffers by these shapes with no bounds checks of its
    own per block."""
    if len(x.shape) != 2:
        raise ValueError(f"dequant_matmul: x must be [T, in], got shape {tuple(x.shape)}")
    shapes = {"qweight": qweight.shape, "scale": scale.shape}
    if offset is not None:
        shapes["offset"] = offset.shape
    for name, shape in shapes.items():
        if len(shape) != 3:
            raise ValueError(f"dequant_matmul: qweight [out / P, in, P], scale and offset "
                             f"[out / P, in // block, P] (cpu_dequant_matmul.pack) must be 3-D; "
                             f"{name} has shape {tuple(shape)}")
    if jnp.dtype(qweight.dtype) != jnp.int8:
        raise ValueError(f"dequant_matmul: qweight must be int8, got {qweight.dtype}")
    for name, arr in (("scale", scale), ("offset", offset)):
        if arr is not None and jnp.dtype(arr.dtype) != jnp.float32:
            raise ValueError(f"dequant_matmul: {name} must be float32, got {arr.dtype}")
    (panels, cols, p), (spanels, blocks, sp) = qweight.shape, scale.shape
    if p not in PANEL_SIZES:
        raise ValueError(f"dequant_matmul: panels of {p} features; the kernel takes "
                         f"{' / '.join(map(str, PANEL_SIZES))}")
    if x.shape[1] != cols:
        raise ValueError(f"dequant_matmul: x [T, in] has in={x.shape[1]}, qweight has "
                         f"in={cols}")
    if (spanels, sp) != (panels, p) or blocks == 0 or cols % blocks \
            or cols // blocks not in (16, 32):
        raise ValueError(f"dequant_matmul: scale {tuple(scale.shape)} must be [out / P, "
                         f"in // block, P] with a block of 16 or 32 values for qweight "
                         f"{tuple(qweight.shape)}")
    if offset is not None and tuple(offset.shape) != tuple(scale.shape):
        raise ValueError(f"dequant_matmul: offset {tuple(offset.shape)} must have scale's shape "
                         f"{tuple(scale.shape)}")


def dequant_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                   offset: jax.Array | None) -> jax.Array:
    """x [T, in] times the dequantized weight [out, in] transposed -> [T, out] float32, the
    weight in `pack`'s layout and read once. Needs `available()`; blocks of 16 or 32 values;
    other operands raise ValueError (check_inputs)."""
    check_inputs(x, qweight, scale, offset)
    if not available():
        raise RuntimeError("the CPU dequant matmul kernel is not available (see the warning)")
    t, n = x.shape[0], qweight.shape[0] * qweight.shape[2]
    has_offset = offset is not None
    if offset is None:
        offset = jnp.zeros((0, 0, 0), jnp.float32)  # the FFI signature wants a buffer
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((t, n), jnp.float32))
    return call(x.astype(jnp.float32), qweight, scale, offset, has_offset=has_offset)
