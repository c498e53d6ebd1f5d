"""GGUF block formats repacked into int8 values plus one f32 scale (and offset) per block.

Every supported format dequantizes as `q * scale + offset` with q a small integer, scale and
offset constant over a block of 32 values (16 for Q6_K's sub-blocks), so a tensor becomes
  qweight int8 [rows, cols], scale f32 [rows, cols // block], offset f32 [rows, cols // block]
(offset None for formats without mins). Scales and offsets are computed in float32 exactly as
`gguf.quants.dequantize` computes them (e.g. Q4_K: d * sc and dmin * m), so
`q * scale + offset` is bit-for-bit gguf's value: `d * q - dm` == `q * d + (-dm)` in IEEE
arithmetic, and for the K formats the products are exact anyway (an f16 times a 6-bit integer
times a 5-bit one fits in float32's 24-bit mantissa), so a fused multiply-add cannot change them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

QK_K = 256  # values per K-format super-block


class RepackedBlocks(NamedTuple):
    qweight: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // block]
    offset: np.ndarray | None  # float32 [rows, cols // block], None when the format has no mins

    @property
    def block_size(self) -> int:
        return self.qweight.shape[1] // self.scale.shape[1]


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian f16 fields ([n, 2] uint8) -> float32 [n, 1], as gguf converts them."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray):
    return _nibbles(b[:, 2:]).astype(np.int8) - 8, _f16(b[:, :2]), None


def _q5_0(b: np.ndarray):
    # Bit j of the little-endian 32-bit qh is the fifth bit of value j.
    high = np.unpackbits(b[:, 2:6], axis=-1, bitorder="little")
    quants = _nibbles(b[:, 6:]) | (high << 4)
    return quants.astype(np.int8) - 16, _f16(b[:, :2]), None


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 (scale, min) 6-bit pairs of a Q4_K / Q5_K super-block from its 12 packed bytes."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_scale_offset(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return d * sc, -(dmin * mn)


def _q4_k(b: np.ndarray):
    n = len(b)
    # 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low and 2c+1 in its high nibbles.
    quants = _nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, QK_K)
    return (quants.astype(np.int8), *_k_scale_offset(b))


def _q5_k(b: np.ndarray):
    n = len(b)
    low = _nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    # Byte i of qh carries the fifth bit of value i of every sub-block j, in bit j.
    high = np.unpackbits(b[:, 16:48], axis=-1, bitorder="little").reshape(n, 32, 8)
    quants = (low | (high.transpose(0, 2, 1) << 4)).reshape(n, QK_K)
    return (quants.astype(np.int8), *_k_scale_offset(b))


def _q6_k(b: np.ndarray):
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    # Per 128-value half: values l, l+32 take ql[l], ql[l+32] low nibbles, l+64, l+96 their
    # high nibbles; the two high bits come from qh[l] at shifts 0, 2, 4, 6 in that order.
    quants = _nibbles(ql).reshape(n, 2, 4, 32) | ((qh & 3) << 4)
    scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (quants.reshape(n, QK_K).astype(np.int8) - 32, scale, None)


# type name -> (values per block, bytes per block, sub-block size, unpack)
_FORMATS = {
    "Q4_0": (32, 18, 32, _q4_0),
    "Q5_0": (32, 22, 32, _q5_0),
    "Q8_0": (32, 34, 32, _q8_0),
    "Q4_K": (QK_K, 144, 32, _q4_k),
    "Q5_K": (QK_K, 176, 32, _q5_k),
    "Q6_K": (QK_K, 210, 16, _q6_k),
}
SUPPORTED_TYPES = tuple(_FORMATS)
# Tensor types that are not block formats: they load as float32, as with quantization="none".
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class UnsupportedGGUFType(ValueError):
    pass


def repack(data: np.ndarray, type_name: str, shape: tuple[int, ...],
           tensor_name: str = "tensor") -> RepackedBlocks:
    """Raw GGUF bytes of one tensor ([rows, bytes per row] uint8, as `GGUFReader` gives them)
    -> int8 values and per-block f32 scale / offset, `shape` [rows, cols] in numpy order."""
    if type_name not in _FORMATS:
        raise UnsupportedGGUFType(
            f"{tensor_name}: GGUF type {type_name} cannot be kept quantized (supported: "
            f"{', '.join(SUPPORTED_TYPES)}); load with quantization='none' to dequantize it")
    per_block, nbytes, sub, unpack = _FORMATS[type_name]
    rows, cols = int(np.prod(shape[:-1])), int(shape[-1])
    if cols % per_block:
        raise UnsupportedGGUFType(f"{tensor_name}: row length {cols} is not a multiple of the "
                                  f"{type_name} block ({per_block})")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, nbytes)
    if len(blocks) != rows * cols // per_block:
        raise ValueError(f"{tensor_name}: {len(blocks)} {type_name} blocks for shape {shape}")
    quants, scale, offset = unpack(blocks)
    subs = cols // sub
    return RepackedBlocks(
        np.ascontiguousarray(quants, dtype=np.int8).reshape(rows, cols),
        np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, subs),
        None if offset is None else np.ascontiguousarray(offset, np.float32).reshape(rows, subs))


def dequantize(r: RepackedBlocks) -> np.ndarray:
    """float32 [rows, cols]: the reference for the device-side dequantization."""
    rows, cols = r.qweight.shape
    w = r.qweight.reshape(rows, -1, r.block_size).astype(np.float32) * r.scale[..., None]
    if r.offset is not None:
        w = w + r.offset[..., None]
    return w.reshape(rows, cols)


def concat_rows(parts: list[RepackedBlocks]) -> RepackedBlocks:
    """Stack tensors along rows (fused q/k/v or gate/up), bit-exactly: blocks are split to the
    smallest block size (repeating their scale), and a part without offsets gets -0.0, the one
    value x + o == x holds for (also for x = -0.0, which +0.0 would turn positive)."""
    block = min(p.block_size for p in parts)
    with_offset = any(p.offset is not None for p in parts)
    scales, offsets = [], []
    for p in parts:
        rep = p.block_size // block
        scales.append(np.repeat(p.scale, rep, axis=1))
        if with_offset:
            off = p.offset if p.offset is not None else np.full_like(p.scale, -0.0)
            offsets.append(np.repeat(off, rep, axis=1))
    return RepackedBlocks(np.concatenate([p.qweight for p in parts]), np.concatenate(scales),
                          np.concatenate(offsets) if with_offset else None)
