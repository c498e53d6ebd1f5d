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
import platform
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers import cpu_ffi

SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "jaxllm_dequant_matmul"
_TARGET_Q5 = "jaxllm_dequant_matmul_q5"
_TARGET_INT8 = "jaxllm_int8_matmul"


def available(isa: str | None = None) -> bool:
    """Whether the kernel's `isa` build (cpu_ffi.ISA_FLAGS; default the process's,
    $JAXLLM_CPU_ISA) is built and registered (decided once per process and build); False with a
    warning when it cannot be built, silently when $JAXLLM_CPU_KERNELS=0."""
    return _available(cpu_ffi.resolve_isa(isa))


@functools.cache
def _available(isa: str) -> bool:
    return cpu_ffi.register(SOURCE, {_TARGET: "JaxllmDequantMatmul",
                                     _TARGET_Q5: "JaxllmDequantMatmulQ5",
                                     _TARGET_INT8: "JaxllmInt8Matmul"},
                            ".gguf models load dequantized by default, and quantization='gguf' "
                            "runs XLA's fused GEMVs (slower)", isa)


PANEL_SIZES = (64, 32, 16)  # output features per panel, the largest that divides `out`


def panel_size(out_features: int) -> int | None:
    """The panel width `pack` uses for a weight of `out_features` rows; None when no width
    divides it (such a weight stays float32)."""
    return next((p for p in PANEL_SIZES if out_features % p == 0), None)


Q5_PANEL = 64  # output features per 5-bit panel
Q5_BYTES = 40  # bytes per k of a 5-bit panel: 32 of nibbles, 8 of signs


def pack(qweight: np.ndarray, scale: np.ndarray, offset: np.ndarray | None,
         compact: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The kernel's layout of a repacked GGUF weight (int8 [out, in], per-block scale/offset
    [out, in // block]): panels of P output features, k-major inside, scale/offset [out / P,
    in // block, P], and the values int8 [out / P, in, P]; with `compact`, where they fit 5 bits
    (-16..15: Q5_0, Q4_0, Q4_K, or any tensor whose values happen to) and the panels are 64
    wide, 5-bit panels uint8 [out / 64, in, 40] instead (`pack_q5`: fewer bytes, more work per
    weight; cpu_dequant_matmul.cc). The same values, moved."""
    out = qweight.shape[0]
    p = panel_size(out)
    if p is None:
        raise ValueError(f"dequant_matmul: out ({out}) must be a multiple of 16")

    def panels(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.reshape(out // p, p, a.shape[1]).transpose(0, 2, 1))

    values = panels(qweight)
    if compact and p == Q5_PANEL and qweight.size and qweight.min() >= -16 \
            and qweight.max() <= 15:
        values = pack_q5(values)
    return values, panels(scale), None if offset is None else panels(offset)


def pack_q5(values: np.ndarray) -> np.ndarray:
    """int8 panels [out / 64, in, 64] of values in -16..15 -> uint8 [out / 64, in, 40]: per k,
    byte j holds feature j's low nibble and feature j + 32's in its high half, then 64 sign
    bits (feature f's in bit f % 8 of byte 32 + f // 8); a value is nibble - 16 * sign."""
    nibbles = (values & 15).astype(np.uint8)
    packed = nibbles[..., :32] | (nibbles[..., 32:] << 4)
    signs = np.packbits(values < 0, axis=-1, bitorder="little")
    return np.ascontiguousarray(np.concatenate([packed, signs], axis=-1))


def int8_supported(isa: str | None = None) -> bool:
    """Whether the `isa` build has the integer path (`int8_matmul`): x86 with AVX2 (every
    machine that runs the avx2 build; the native build of an AVX2 or AVX-512 CPU). Elsewhere
    (aarch64, x86 without AVX2) it is not compiled, and the exact path runs."""
    isa = cpu_ffi.resolve_isa(isa)
    if platform.machine() not in ("x86_64", "AMD64") or not cpu_ffi.runs_here(isa):
        return False
    return isa == "avx2" or cpu_ffi.runs_here("avx2")


INT8_GROUP = 4  # consecutive k per 32-bit lane of the integer layout
INT8_MAX = 127  # largest unsigned value: maddubs' pair sums (2 * 128 * 127) must not saturate
INT8_PANEL = 64  # output features per panel of the nibble-packed layout
INT8_QUAD = INT8_PANEL * INT8_GROUP  # values per k-quad of such a panel
NIBBLE_BYTES = INT8_QUAD // 2  # a quad's low nibbles, two values a byte
PLANE_BYTES = INT8_QUAD // 8  # a quad's bits above the fourth, one plane per bit
PACKED_BITS = (4, 5, 6)  # value widths the nibble-packed layout holds


def _int8_bits(a: Any) -> int | None:
    """The value width of a nibble-packed integer weight (4 to 6), 8 for the byte layout, None
    for neither."""
    shape = a.shape
    if len(shape) == 4 and shape[3] == INT8_GROUP:
        return 8
    if len(shape) == 3 and jnp.dtype(a.dtype) in (jnp.uint8, jnp.int8):
        planes, rest = divmod(shape[2] - NIBBLE_BYTES, PLANE_BYTES)
        if rest == 0 and 0 <= planes <= 2:
            return 4 + planes
    return None


def int8_zero(qweight: Any) -> int:
    """What a nibble-packed weight's stored values exceed its GGUF values by: 2^(bits - 1) for
    signed formats (int8 marks them), 0 for unsigned ones; 0 for the byte layout, whose zero is
    folded into the offset."""
    bits = _int8_bits(qweight)
    if bits is None or bits == 8 or jnp.dtype(qweight.dtype) != jnp.int8:
        return 0
    return 1 << (bits - 1)


def _nibble_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Quads [..., 256] of unsigned values under 2^bits -> [..., 128 + 32 (bits - 4)] bytes:
    byte i holds value i's low nibble and value i + 128's in its high half, then per bit above
    the fourth a plane whose byte i has value 32 b + i's bit in its bit b."""
    nib = (values[..., :NIBBLE_BYTES] & 15) | ((values[..., NIBBLE_BYTES:] & 15) << 4)
    parts = [nib.astype(np.uint8)]
    for plane in range(bits - 4):
        bit = ((values >> (4 + plane)) & 1).astype(np.uint8)
        bit = np.swapaxes(bit.reshape(*bit.shape[:-1], 8, PLANE_BYTES), -1, -2)
        parts.append(np.packbits(bit, axis=-1, bitorder="little")[..., 0])
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def _nibble_unpack(a: Any, bits: int) -> Any:
    """`_nibble_pack`'s inverse (numpy or jax): [..., 128 + 32 (bits - 4)] -> [..., 256]."""
    xp = np if isinstance(a, np.ndarray) else jnp
    a = a.view(xp.uint8) if a.dtype == xp.int8 else a
    nib = a[..., :NIBBLE_BYTES]
    values = xp.concatenate([nib & 15, nib >> 4], axis=-1).astype(xp.int16)
    for plane in range(bits - 4):
        bytes_ = a[..., NIBBLE_BYTES + plane * PLANE_BYTES:NIBBLE_BYTES + (plane + 1) * PLANE_BYTES]
        bit = xp.unpackbits(bytes_[..., None], axis=-1, bitorder="little")  # [..., i, b]
        bit = xp.swapaxes(bit, -1, -2).reshape(*a.shape[:-1], INT8_QUAD)
        values = values + (bit.astype(xp.int16) << (4 + plane))
    return values


def pack_int8(qweight: np.ndarray, scale: np.ndarray, offset: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The integer path's layout of a repacked GGUF weight; scale and offset as `pack`'s panels,
    in float16 (the path rounds activations to 8 bits, far coarser than float16's scales);
    ValueError where one does not fit float16's normal range.

    Where the panels are 64 wide and the values take 4 to 6 bits (Q4_K, Q5_K, Q6_K, Q5_0,
    Q4_0), nibble-packed [out / 64, in / 4, 128 + 32 (bits - 4)]: per 4 consecutive k ("quad")
    the 256 values of the byte layout below, two a byte, and a plane per bit above the fourth
    (`_nibble_pack`), so a weight is read at its own width; signed values stored as q + 2^(bits
    - 1), marked by int8 (`int8_zero`: the kernel subtracts it times the activations' block sum,
    beside any offset).

    Otherwise bytes [out / P, in / 4, P, 4] (4 consecutive k of a feature side by side):
    unsigned where they can be (u = q + zero, 0..127, zero a power of two folded into the
    offset, -zero * scale), else signed int8 (Q8_0's full range, or rows of signed and offset
    formats fused)."""
    out, cols = qweight.shape
    p = panel_size(out)
    if p is None or cols % 32:
        raise ValueError(f"int8 layout: out ({out}) must be a multiple of 16 and in ({cols}) "
                         f"of 32")
    lo, hi = (int(qweight.min()), int(qweight.max())) if qweight.size else (0, 0)
    zero = 0 if lo >= 0 else 1 << (-lo - 1).bit_length()
    unsigned = hi + zero <= INT8_MAX and (zero == 0 or offset is None)
    # Width of the values as stored: unsigned, or signed in two's complement range.
    bits = max(4, hi.bit_length() if zero == 0 else max(hi, -lo - 1).bit_length() + 1)
    grouped = qweight.astype(np.int16).reshape(out // p, p, cols // INT8_GROUP, INT8_GROUP
                                              ).transpose(0, 2, 1, 3)
    # Nibble-packed values carry their zero to the kernel, not in the offset: signed rows
    # fused with offset rows pack too.
    if p == INT8_PANEL and bits in PACKED_BITS:
        zero = 1 << (bits - 1) if zero else 0
        quads = (grouped + zero).reshape(out // p, cols // INT8_GROUP, INT8_QUAD)
        values = _nibble_pack(quads, bits)
        if zero:
            values = values.view(np.int8)
    elif unsigned:
        values = np.ascontiguousarray((grouped + zero).astype(np.uint8))
        if zero:
            offset = (scale * np.float32(-zero)).astype(np.float32)
    else:
        values = np.ascontiguousarray(grouped.astype(np.int8))

    def panels(a: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            half = a.astype(np.float16)
        # Within float16's normal range a value rounds by at most 2^-11 of itself; past its
        # largest value or below its smallest normal one (unless exact there) it would not.
        moved = np.abs(half.astype(np.float32) - a) > np.abs(a) * np.float32(2.0 ** -11)
        if np.any(moved | (np.isfinite(a) & ~np.isfinite(half))):
            raise ValueError("int8 layout: a block scale or offset does not fit float16 (the "
                             "integer path's scales); load without cpu_int8_activations")
        return np.ascontiguousarray(half.reshape(out // p, p, a.shape[1]).transpose(0, 2, 1))

    return values, panels(scale), None if offset is None else panels(offset)


def is_int8(a: Any) -> bool:
    """Whether `a` is values in one of the integer path's layouts (`pack_int8`)."""
    return _int8_bits(a) is not None


def _int8_values(a: Any) -> Any:
    """Integer-path values -> the GGUF values (with the byte layout's folded zero, whose offset
    makes them the same weight) as int8 [out / P, in / 4, P, 4] (numpy or jax)."""
    xp = np if isinstance(a, np.ndarray) else jnp
    bits = _int8_bits(a)
    if bits is None:
        raise ValueError(f"not an integer-path layout: shape {tuple(a.shape)}, {a.dtype}")
    if bits == 8:
        return a.astype(xp.int8)
    values = _nibble_unpack(a, bits) - int8_zero(a)
    return values.astype(xp.int8).reshape(*a.shape[:2], INT8_PANEL, INT8_GROUP)


def is_q5(a: Any) -> bool:
    return jnp.dtype(a.dtype) == jnp.uint8 and len(a.shape) == 3 and a.shape[2] == Q5_BYTES


def _q5_values(a: Any) -> Any:
    """uint8 [..., 40] 5-bit panel bytes -> int8 [..., 64] values (numpy or jax)."""
    xp = np if isinstance(a, np.ndarray) else jnp
    nib = xp.concatenate([a[..., :32] & 15, a[..., :32] >> 4], axis=-1).astype(xp.int8)
    signs = xp.unpackbits(a[..., 32:], axis=-1, bitorder="little").astype(xp.int8)
    return nib - signs * xp.int8(16)


def unpack(a: Any) -> Any:
    """[out / P, cols, P] (or a 5-bit panel's [out / 64, cols, 40]) -> [out, cols]: `pack`'s
    inverse for one array (numpy or jax)."""
    if is_q5(a):
        a = _q5_values(a)
    if is_int8(a):
        panels, groups, p, g = (a := _int8_values(a)).shape
        return a.transpose(0, 2, 1, 3).reshape(panels * p, groups * g)
    panels, cols, p = a.shape
    return a.transpose(0, 2, 1).reshape(panels * p, cols)


def take_rows(a: Any, rows: jax.Array) -> jax.Array:
    """Rows [len(rows), cols] of a packed array without unpacking the rest (the embedding's
    gather): row r is feature r % P of panel r // P."""
    if is_int8(a):
        a = _int8_values(a)
        p = a.shape[2]
        return a[rows // p, :, rows % p, :].reshape(len(rows), -1)
    if not is_q5(a):
        p = a.shape[2]
        return a[rows // p, :, rows % p]
    panel, f = rows // Q5_PANEL, rows % Q5_PANEL
    nib = (a[panel, :, f % 32] >> (4 * (f // 32)).astype(jnp.uint8)[:, None]) & 15
    sign = (a[panel, :, 32 + f // 8] >> (f % 8).astype(jnp.uint8)[:, None]) & 1
    return nib.astype(jnp.int8) - sign.astype(jnp.int8) * jnp.int8(16)


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
    q5 = is_q5(qweight)
    if jnp.dtype(qweight.dtype) != jnp.int8 and not q5:
        raise ValueError(f"dequant_matmul: qweight must be int8 panels [out / P, in, P] or "
                         f"5-bit panels uint8 [out / 64, in, {Q5_BYTES}], got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    for name, arr in (("scale", scale), ("offset", offset)):
        if arr is not None and jnp.dtype(arr.dtype) != jnp.float32:
            raise ValueError(f"dequant_matmul: {name} must be float32, got {arr.dtype}")
    (panels, cols, p), (spanels, blocks, sp) = qweight.shape, scale.shape
    if q5:
        p = Q5_PANEL
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
                   offset: jax.Array | None, *, isa: str | None = None) -> jax.Array:
    """x [T, in] times the dequantized weight [out, in] transposed -> [T, out] float32, the
    weight in `pack`'s layout and read once, by the kernel's `isa` build (default the
    process's). Needs `available(isa)`; blocks of 16 or 32 values; other operands raise
    ValueError (check_inputs)."""
    check_inputs(x, qweight, scale, offset)
    isa = cpu_ffi.resolve_isa(isa)
    if not available(isa):
        raise RuntimeError(f"the CPU dequant matmul kernel's {isa} build is not available (see "
                           f"the warning)")
    t, n = x.shape[0], scale.shape[0] * scale.shape[2]
    has_offset = offset is not None
    if offset is None:
        offset = jnp.zeros((0, 0, 0), jnp.float32)  # the FFI signature wants a buffer
    target = cpu_ffi.target_name(_TARGET_Q5 if is_q5(qweight) else _TARGET, isa)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, n), jnp.float32))
    return call(x.astype(jnp.float32), qweight, scale, offset, has_offset=has_offset)


def int8_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array, offset: jax.Array | None,
                *, isa: str | None = None) -> jax.Array:
    """x [T, in] times a `pack_int8` weight -> [T, out] float32 by the integer path: x
    quantized to int8 per block of 32 in the kernel (cpu_dequant_matmul.cc), integer dot
    products against the weight's values, then the blocks' scales and offsets. Not exact (x is
    rounded to 8 bits, the scales to float16); needs `int8_supported(isa)`."""
    isa = cpu_ffi.resolve_isa(isa)
    if not (int8_supported(isa) and available(isa)):
        raise RuntimeError(f"the CPU kernel's {isa} build has no integer path here")
    if len(x.shape) != 2 or not is_int8(qweight) or x.shape[1] != qweight.shape[1] * INT8_GROUP:
        raise ValueError(f"int8_matmul: x [T, in] and values [out / P, in / 4, P, 4] or "
                         f"nibble-packed [out / 64, in / 4, {NIBBLE_BYTES} + {PLANE_BYTES} "
                         f"(bits - 4)], got {tuple(x.shape)} and {tuple(qweight.shape)}")
    if jnp.dtype(qweight.dtype) not in (jnp.uint8, jnp.int8):
        raise ValueError(f"int8_matmul: values must be uint8 or int8, got {qweight.dtype}")
    for name, arr in (("scale", scale), ("offset", offset)):
        if arr is not None and jnp.dtype(arr.dtype) != jnp.float16:
            raise ValueError(f"int8_matmul: {name} must be float16 (pack_int8), got {arr.dtype}")
    t, n = x.shape[0], scale.shape[0] * scale.shape[2]
    has_offset = offset is not None
    if offset is None:
        offset = jnp.zeros((0, 0, 0), jnp.float16)
    target = cpu_ffi.target_name(_TARGET_INT8, isa)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((t, n), jnp.float32))
    return call(x.astype(jnp.float32), qweight, scale, offset, has_offset=has_offset,
                zero=np.int64(int8_zero(qweight)))
