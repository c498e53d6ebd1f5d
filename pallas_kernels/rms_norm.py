"""RMSNorm (Qwen2RMSNorm) and vLLM's fused residual-add + RMSNorm.

One public function, `rms_norm`, picks the implementation:
  "pallas"    the Triton-backed Pallas kernel (GPU),
  "interpret" the same pallas_call in interpret mode (CPU, for tests),
  "reference" plain jax.numpy (XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_backend, next_pow2, prev_pow2

# Elements of one row block held in registers by one program. 4096 f32 values over
# 4-8 warps keeps register use modest while giving each program enough work for T=1..2048.
_BLOCK_ELEMS = 4096
# An H100 has 132 SMs; fewer programs than this leaves SMs idle.
_MIN_PROGRAMS = 128


# --------------------------------------------------------------------------- reference


def rms_norm_reference(
    x: jax.Array, weight: jax.Array, eps: float, residual: jax.Array | None = None
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Plain jax.numpy RMSNorm; see `rms_norm` for the contract."""
    dtype = x.dtype
    if residual is not None:
        # The residual stream is kept in the model dtype (as Hugging Face and vLLM do), so the
        # sum is rounded once to `dtype` and the norm is taken of that rounded value.
        h = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(dtype)
        return _normalize(h, weight, eps), h
    return _normalize(x, weight, eps)


def _normalize(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------- pallas kernel


def _rms_norm_kernel(*refs, eps: float, n_rows: int, hidden: int, block_rows: int,
                     block_cols: int, has_residual: bool):
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, h_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
        r_ref = h_ref = None
    # Refs are the whole (unblocked) arrays: Triton only accepts power-of-two tensors, and
    # hidden sizes like 896 are not, so each program loads a padded power-of-two tile with a
    # mask and the padding lanes contribute zeros to the sum of squares.
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(block_cols)
    row_mask = rows < n_rows
    col_mask = cols < hidden
    mask = row_mask[:, None] & col_mask[None, :]
    idx = (rows[:, None], cols[None, :])

    x = plgpu.load(x_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
    if has_residual:
        assert r_ref is not None and h_ref is not None
        r = plgpu.load(r_ref.at[idx], mask=mask, other=0.0).astype(jnp.float32)
        h = (x + r).astype(h_ref.dtype)
        plgpu.store(h_ref.at[idx], h, mask=mask)
        # Normalise the value as stored (rounded to the model dtype), like the reference.
        x = h.astype(jnp.float32)
    w = plgpu.load(w_ref.at[cols], mask=col_mask, other=0.0).astype(jnp.float32)

    # Divide by the true hidden size, not the padded width.
    var = jnp.sum(x * x, axis=1) / hidden
    rstd = jax.lax.rsqrt(var + eps)
    y = x * rstd[:, None] * w[None, :]
    plgpu.store(y_ref.at[idx], y.astype(y_ref.dtype), mask=mask)


def _rms_norm_pallas(x: jax.Array, weight: jax.Array, eps: float, residual: jax.Array | None,
                     interpret: bool) -> tuple[jax.Array, jax.Array | None]:
    """(y, h): h, the stored residual sum, is None without a residual."""
    n_rows, hidden = x.shape
    block_cols = next_pow2(hidden)
    # Rows per program: as many as fit _BLOCK_ELEMS, but keep >= ~_MIN_PROGRAMS programs so a
    # decode batch (T ~ 64) still spreads over the SMs instead of a handful of programs.
    block_rows = min(max(1, _BLOCK_ELEMS // block_cols), prev_pow2(n_rows // _MIN_PROGRAMS))
    num_warps = 8 if block_rows * block_cols >= 4096 else 4
    has_residual = residual is not None
    kernel = functools.partial(
        _rms_norm_kernel, eps=float(eps), n_rows=n_rows, hidden=hidden,
        block_rows=block_rows, block_cols=block_cols, has_residual=has_residual)
    out_sd = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out_shape = (out_sd, out_sd) if has_residual else out_sd
    call = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(n_rows, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rms_norm_residual" if has_residual else "rms_norm",
    )
    if has_residual:
        y, h = call(x, residual, weight)
        return y, h
    return call(x, weight), None


# --------------------------------------------------------------------------- public


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    residual: jax.Array | None = None,
    *,
    backend: str = "reference",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm over the last axis.

    x: [T, hidden] (any leading dims are accepted and kept); weight: [hidden].
    Without residual returns y = x * rsqrt(mean(x^2, -1) + eps) * weight.
    With residual (vLLM's fused_add_rms_norm): h = x + residual (rounded to x.dtype);
    returns (rms_norm(h), h). Computes in float32, returns x.dtype.
    """
    check_backend(backend)
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm expects x [T, hidden] and weight [hidden], got "
                         f"{x.shape} and {weight.shape}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {residual.shape} != x shape {x.shape}")
    return _rms_norm_jit(x, weight, residual, eps=float(eps), backend=backend)


# Jitted so eager callers (tests, benchmarks) reuse the compiled op instead of re-tracing the
# pallas_call on every call; inside the model's jit this simply inlines.
@functools.partial(jax.jit, static_argnames=("eps", "backend"))
def _rms_norm_jit(x, weight, residual, *, eps: float, backend: str):
    if backend == "reference":
        return rms_norm_reference(x, weight, eps, residual)
    # The kernel works on rows; any leading dims are flattened into T (a free reshape).
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = None if residual is None else residual.reshape(x2.shape)
    y, h = _rms_norm_pallas(x2, weight, eps, r2, interpret=backend == "interpret")
    if h is None:
        return y.reshape(shape)
    return y.reshape(shape), h.reshape(shape)

