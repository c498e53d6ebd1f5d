"""y = x @ dequantize(w).T for GGUF weights kept quantized as int8 blocks (fused dequant matmul).

The weight layout is what the GGUF repacker produces: int8 values `qweight` [N, K], and per
block of `group` (16 or 32) consecutive values along K one float32 `scale` and, for formats with
mins, one float32 `offset` ([N, K // group] each). A weight element is `q * scale + offset`,
formed in registers from its int8 value: the weight is read from memory as one byte per element
(plus 4-8 bytes per block), never as a dequantized float copy.

Numbers: the dequantized weight is rounded to the activation dtype (a no-op for float32, the
tensor cores' operand for bfloat16), products and sums are float32, the result is `out_dtype`
(default: x's). The sum order is the kernel's, so results match the reference to rounding, not
bit for bit. (In interpret mode XLA on CPU may skip the weight's rounding to bfloat16, as its
`xla_allow_excess_precision` lets it; Triton rounds as written.)

Two Triton kernels, picked by the row count M (static):
  "gemv" (M < 16, decode): one program per tile of BN output features holds a dequantized
         [BN, BK] weight tile and multiplies it into every row (rows unrolled, element-wise
         multiply and row sums on the CUDA cores; Triton's dot needs M >= 16);
  "gemm" (M >= 16, prefill and large decode buckets): [BM, BN] output tiles, a K loop of
         `dot(x tile, dequantized weight tile^T)` on the tensor cores (bfloat16) or IEEE
         float32 FMA dots (float32, no TF32).
One public function, `dequant_matmul`, picks the implementation like the other kernels:
"pallas" (Triton, GPU), "interpret" (the same kernels on CPU, for tests), "reference" (XLA).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_backend, next_pow2

# Triton's smallest dot tile has 16 rows: fewer rows run the GEMV kernel.
GEMM_MIN_ROWS = 16
# GEMV: elements of the [BN, BK] weight tile one program dequantizes per K step. The int8
# values, their gathered scales / offsets (a 64-bit pointer per lane each) and the float32 tile
# each cost this / (32 x warps) registers per thread: 1024 over 4 warps compiles with no spills
# at every Qwen2.5 shape, 2048 spills at some (docs/perf/gpu-kernel-model.md).
_GEMV_TILE_ELEMS = 1024
# An H100 has 132 SMs: the GEMV narrows BN (down to _GEMV_MIN_BN; it has no dot, so no
# 16-row minimum) before leaving them idle.
_MIN_PROGRAMS = 264
_GEMV_MIN_BN = 4


# --------------------------------------------------------------------------- reference


def dequantize_reference(qweight: jax.Array, scale: jax.Array,
                         offset: jax.Array | None) -> jax.Array:
    """float32 [N, K]: q * scale + offset, blockwise along K."""
    n, k = qweight.shape
    group = k // scale.shape[1]
    w = qweight.reshape(n, -1, group).astype(jnp.float32) * scale[..., None]
    if offset is not None:
        w = w + offset[..., None]
    return w.reshape(n, k)


def dequant_matmul_reference(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                             offset: jax.Array | None = None, out_dtype: Any = None) -> jax.Array:
    """Plain XLA: the dequantized weight (rounded to x's dtype), float32 products and sums."""
    w = dequantize_reference(qweight, scale, offset).astype(x.dtype).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


# --------------------------------------------------------------------------- pallas kernels


def _dequant_tile(q_ref, s_ref, off_ref, cols, cols_ok, k, k_ok, group: int, dtype):
    """The [BN, BK] weight tile of output features `cols`, K positions `k`, dequantized in
    float32 and rounded to the activation dtype; out-of-range lanes are 0."""
    ok = cols_ok[:, None] & k_ok[None, :]
    q = plgpu.load(q_ref.at[cols[:, None], k[None, :]], mask=ok, other=0)
    # Every lane gathers its own block's scale: `group` neighbouring lanes share an address,
    # which the cache serves; no reshape of the tile is needed.
    blk = (cols[:, None], (k // group)[None, :])
    w = q.astype(jnp.float32) * plgpu.load(s_ref.at[blk], mask=ok, other=0.0)
    if off_ref is not None:
        w = w + plgpu.load(off_ref.at[blk], mask=ok, other=0.0)
    return w.astype(dtype)


def _split_refs(refs, has_offset: bool):
    if has_offset:
        x_ref, q_ref, s_ref, off_ref, o_ref = refs
    else:
        (x_ref, q_ref, s_ref, o_ref), off_ref = refs, None
    return x_ref, q_ref, s_ref, off_ref, o_ref


def _gemv_kernel(*refs, has_offset: bool, group: int, block_n: int, block_k: int):
    x_ref, q_ref, s_ref, off_ref, o_ref = _split_refs(refs, has_offset)
    m, k_dim = x_ref.shape
    n = q_ref.shape[0]
    cols = pl.program_id(0) * block_n + jnp.arange(block_n)
    cols_ok = cols < n

    def body(kb, accs):
        k = kb * block_k + jnp.arange(block_k)
        k_ok = k < k_dim
        w = _dequant_tile(q_ref, s_ref, off_ref, cols, cols_ok, k, k_ok, group,
                          x_ref.dtype).astype(jnp.float32)
        out = []
        for i, acc in enumerate(accs):  # the tile is dequantized once for all M rows
            xi = plgpu.load(x_ref.at[i, k], mask=k_ok, other=0.0).astype(jnp.float32)
            out.append(acc + jnp.sum(w * xi[None, :], axis=1))
        return tuple(out)

    zeros = tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(m))
    accs = lax.fori_loop(0, pl.cdiv(k_dim, block_k), body, zeros)
    # Masked lanes point out of bounds: the interpreter drops such scatter indices.
    safe_cols = jnp.where(cols_ok, cols, n)
    for i, acc in enumerate(accs):
        plgpu.store(o_ref.at[i, safe_cols], acc.astype(o_ref.dtype), mask=cols_ok)


def _gemm_kernel(*refs, has_offset: bool, group: int, block_m: int, block_n: int,
                 block_k: int):
    x_ref, q_ref, s_ref, off_ref, o_ref = _split_refs(refs, has_offset)
    m, k_dim = x_ref.shape
    n = q_ref.shape[0]
    cols = pl.program_id(0) * block_n + jnp.arange(block_n)
    rows = pl.program_id(1) * block_m + jnp.arange(block_m)
    cols_ok, rows_ok = cols < n, rows < m

    def body(kb, acc):
        k = kb * block_k + jnp.arange(block_k)
        k_ok = k < k_dim
        x = plgpu.load(x_ref.at[rows[:, None], k[None, :]],
                       mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequant_tile(q_ref, s_ref, off_ref, cols, cols_ok, k, k_ok, group, x_ref.dtype)
        # HIGHEST: IEEE float32 for float32 inputs (no TF32); bfloat16 runs on tensor cores.
        return acc + plgpu.dot(x, w, trans_b=True, precision=lax.Precision.HIGHEST)

    acc = lax.fori_loop(0, pl.cdiv(k_dim, block_k), body,
                        jnp.zeros((block_m, block_n), jnp.float32))
    idx = (jnp.where(rows_ok, rows, m)[:, None], jnp.where(cols_ok, cols, n)[None, :])
    plgpu.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=rows_ok[:, None] & cols_ok[None, :])


def launch_config(m: int, n: int, k: int, dtype) -> dict[str, int]:
    """Tile sizes, warps and stages of the kernel for M rows, N outputs, K inputs.

    GEMV: BK up to 256, BN = 1024 / BK, narrowed towards _GEMV_MIN_BN while that leaves
    fewer than _MIN_PROGRAMS programs, 4 warps, 1 stage (2 changed neither registers nor
    spills). GEMM: bfloat16 takes 64 x 64 x 64 tensor-core tiles
    over 4 warps (BM 16 or 32 for smaller buckets); float32 FMA dots keep each thread's operand
    rows in registers over BK (see attention_common.launch_config), so they take 32 x 32 x 32
    tiles over 8 warps (4 warps spilled with offsets); both narrow BN down to 16 while
    there are fewer than _MIN_PROGRAMS programs. No case of check_compile spills
    (docs/perf/gpu-kernel-model.md has the table). Interpret mode runs the same tiles."""
    if m < GEMM_MIN_ROWS:
        block_k = min(next_pow2(k), 256)
        block_n = max(_GEMV_MIN_BN, _GEMV_TILE_ELEMS // block_k)
        while block_n > _GEMV_MIN_BN and pl.cdiv(n, block_n) < _MIN_PROGRAMS:
            block_n //= 2
        cfg = dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=1)
    else:
        if jnp.dtype(dtype) == jnp.float32:
            tile_m, block_n, block_k, num_warps = 32, 32, 32, 8
        else:
            tile_m, block_n, block_k, num_warps = 64, 64, 64, 4
        block_m = min(tile_m, next_pow2(m))
        # A decode bucket (one row tile) narrows its column tiles to spread over the SMs.
        while block_n > 16 and pl.cdiv(n, block_n) * pl.cdiv(m, block_m) < _MIN_PROGRAMS:
            block_n //= 2
        cfg = dict(block_m=block_m, block_n=block_n, block_k=min(block_k, max(16, next_pow2(k))),
                   num_warps=num_warps, num_stages=2)
    # No wider than N needs; a GEMM tile keeps Triton's 16-column minimum for dot (masked).
    floor = _GEMV_MIN_BN if m < GEMM_MIN_ROWS else 16
    cfg["block_n"] = min(cfg["block_n"], max(floor, next_pow2(n)))
    return cfg


def _dequant_matmul_pallas(x, qweight, scale, offset, out_dtype, interpret: bool):
    m, k = x.shape
    n = qweight.shape[0]
    group = k // scale.shape[1]
    cfg = launch_config(m, n, k, x.dtype)
    has_offset = offset is not None
    common = dict(has_offset=has_offset, group=group, block_n=cfg["block_n"],
                  block_k=cfg["block_k"])
    if m < GEMM_MIN_ROWS:
        kernel = functools.partial(_gemv_kernel, **common)
        grid, name = (pl.cdiv(n, cfg["block_n"]),), "dequant_gemv"
    else:
        kernel = functools.partial(_gemm_kernel, block_m=cfg["block_m"], **common)
        grid = (pl.cdiv(n, cfg["block_n"]), pl.cdiv(m, cfg["block_m"]))
        name = "dequant_gemm"
    args = (x, qweight, scale, *((offset,) if has_offset else ()))
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"],
                                             num_stages=cfg["num_stages"]),
        interpret=interpret,
        name=name,
    )(*args)


# --------------------------------------------------------------------------- public


def dequant_matmul(x: jax.Array, qweight: jax.Array, scale: jax.Array,
                   offset: jax.Array | None = None, *, out_dtype: Any = None,
                   backend: str = "reference") -> jax.Array:
    """x [M, K] (bfloat16 or float32) times the dequantized weight [N, K] transposed -> [M, N].

    qweight: int8 [N, K]; scale, offset (optional): float32 [N, K // group], one per block of
    `group` values along K. Returns `out_dtype` (default x.dtype), accumulated in float32."""
    check_backend(backend)
    if x.ndim != 2 or qweight.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"dequant_matmul expects x [M, K], qweight [N, K], scale [N, blocks]; "
                         f"got {x.shape}, {qweight.shape}, {scale.shape}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"x has {k} columns but qweight {qweight.shape} has {qweight.shape[1]}")
    if qweight.dtype != jnp.int8:
        raise ValueError(f"qweight must be int8, got {qweight.dtype}")
    if scale.shape[0] != n or scale.shape[1] == 0 or k % scale.shape[1]:
        raise ValueError(f"scale {scale.shape} does not split qweight {qweight.shape} into "
                         f"whole blocks along K")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset {offset.shape} != scale {scale.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    return _dequant_matmul_jit(x, qweight, scale.astype(jnp.float32),
                               None if offset is None else offset.astype(jnp.float32),
                               out_dtype=out_dtype, backend=backend)


# Jitted so eager callers reuse the compiled op; inside the model's jit this simply inlines.
@functools.partial(jax.jit, static_argnames=("out_dtype", "backend"))
def _dequant_matmul_jit(x, qweight, scale, offset, *, out_dtype, backend: str):
    if backend == "reference":
        return dequant_matmul_reference(x, qweight, scale, offset, out_dtype)
    return _dequant_matmul_pallas(x, qweight, scale, offset, out_dtype,
                                  interpret=backend == "interpret")

