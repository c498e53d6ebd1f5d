"""y = x @ w.T for a few rows of x (decode): a weight-streaming GEMV.

A decode step's weight matmuls have 1-16 rows, so each is bound by reading its weight once
from HBM; a GEMM library tuned for square tiles can leave most of the bandwidth unused there.
This kernel streams the weight [N, K] (the checkpoint's layout, bfloat16 or float32) in
[BN, BK] tiles, each row segment of BK contiguous elements, and multiplies every tile into all M
rows at once (rows unrolled, element-wise products and row sums on the CUDA cores: Triton's dot
needs 16 rows). Products and sums are float32; the result is `out_dtype` (default x's). The
sum order is the kernel's, so results match the reference to rounding, not bit for bit.

One public function, `skinny_matmul`, picks the implementation like the other kernels:
"pallas" (Triton, GPU), "interpret" (the same kernel on CPU, for tests), "reference" (XLA).
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

# Rows above this go to a GEMM (the kernel keeps one accumulator vector per row).
MAX_ROWS = 16
# Elements of the [BN, BK] weight tile a program holds per K step: 2048 keeps the tile and the
# per-row accumulators in registers over 4 warps (16 elements a thread).
_TILE_ELEMS = 2048
# An H100 has 132 SMs: BN narrows (down to _MIN_BN) before fewer programs than this are left,
# so that every SM streams its share of the weight.
_MIN_PROGRAMS = 264
_MIN_BN = 2


def skinny_matmul_reference(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """Plain XLA: float32 products and sums of x and w as given."""
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T,
                precision=lax.Precision.HIGHEST)
    return y.astype(out_dtype or x.dtype)


def _kernel(x_ref, w_ref, o_ref, *, block_n: int, block_k: int):
    m, k_dim = x_ref.shape
    n = w_ref.shape[0]
    cols = pl.program_id(0) * block_n + jnp.arange(block_n)
    cols_ok = cols < n

    def body(kb, accs):
        k = kb * block_k + jnp.arange(block_k)
        k_ok = k < k_dim
        w = plgpu.load(w_ref.at[cols[:, None], k[None, :]],
                       mask=cols_ok[:, None] & k_ok[None, :], other=0.0).astype(jnp.float32)
        out = []
        for i, acc in enumerate(accs):  # the tile is read once for all M rows
            xi = plgpu.load(x_ref.at[i, k], mask=k_ok, other=0.0).astype(jnp.float32)
            out.append(acc + jnp.sum(w * xi[None, :], axis=1))
        return tuple(out)

    zeros = tuple(jnp.zeros((block_n,), jnp.float32) for _ in range(m))
    accs = lax.fori_loop(0, pl.cdiv(k_dim, block_k), body, zeros)
    # Masked lanes point out of bounds: the interpreter drops such scatter indices.
    safe_cols = jnp.where(cols_ok, cols, n)
    for i, acc in enumerate(accs):
        plgpu.store(o_ref.at[i, safe_cols], acc.astype(o_ref.dtype), mask=cols_ok)


def launch_config(m: int, n: int, k: int) -> dict[str, int]:
    """BK up to 512 (1 KiB of a bfloat16 row per load), BN = _TILE_ELEMS / BK narrowed while
    fewer than _MIN_PROGRAMS programs are left, 4 warps, 2 stages (the next tile's loads in
    flight while this one is summed)."""
    del m  # every row shares the tile; the rows only add accumulators
    block_k = min(next_pow2(k), 512)
    block_n = max(_MIN_BN, _TILE_ELEMS // block_k)
    while block_n > _MIN_BN and pl.cdiv(n, block_n) < _MIN_PROGRAMS:
        block_n //= 2
    return dict(block_n=min(block_n, max(_MIN_BN, next_pow2(n))), block_k=block_k,
                num_warps=4, num_stages=2)


def _skinny_matmul_pallas(x, w, out_dtype, interpret: bool):
    m, k = x.shape
    n = w.shape[0]
    cfg = launch_config(m, n, k)
    return pl.pallas_call(
        functools.partial(_kernel, block_n=cfg["block_n"], block_k=cfg["block_k"]),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(n, cfg["block_n"]),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg["num_warps"],
                                             num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)


def skinny_matmul(x: jax.Array, w: jax.Array, *, out_dtype: Any = None,
                  backend: str = "reference") -> jax.Array:
    """x [M, K] times w [N, K] transposed -> [M, N], for 1 <= M <= MAX_ROWS; x and w bfloat16
    or float32 (each read as given), accumulated in float32, returned as `out_dtype` (default
    x.dtype)."""
    check_backend(backend)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_matmul expects x [M, K] and w [N, K]; got {x.shape}, "
                         f"{w.shape}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny_matmul takes 1 to {MAX_ROWS} rows, got {x.shape[0]}")
    for name, a in (("x", x), ("w", w)):
        if a.dtype not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"{name} must be bfloat16 or float32, got {a.dtype}")
    return _skinny_matmul_jit(x, w, out_dtype=jnp.dtype(out_dtype or x.dtype), backend=backend)


# Jitted so eager callers reuse the compiled op; inside the model's jit this simply inlines.
@functools.partial(jax.jit, static_argnames=("out_dtype", "backend"))
def _skinny_matmul_jit(x, w, *, out_dtype, backend: str):
    if backend == "reference":
        return skinny_matmul_reference(x, w, out_dtype)
    return _skinny_matmul_pallas(x, w, out_dtype, interpret=backend == "interpret")
