"""Rotary position embedding, neox / rotate-half style (Hugging Face Qwen2).

One public function, `rope`, picks the implementation:
  "pallas"    the Triton-backed Pallas kernel (GPU),
  "interpret" the same pallas_call in interpret mode (CPU, for tests),
  "reference" plain jax.numpy (XLA).
`rope_cos_sin_cache` builds the [max_position, head_dim] table all of them read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_backend, next_pow2, prev_pow2

# Elements (of one half head) a program rotates per input; bounds register use per program.
_BLOCK_ELEMS = 2048
# Warps per program: enough that each thread holds about this many elements of each of the four
# [rows, heads x half] f32 tiles it keeps live (x1, x2, cos, sin). Register use, and so
# occupancy, is set by elements per thread: 32 per thread per tile left room for too few blocks
# per H100 SM, 4 per thread keeps occupancy high (docs/perf/gpu-kernel-model.md).
# More warps per program rather than only smaller tiles, because one token's row (every head)
# is the smallest tile: for 7B (32 padded heads x 64) a row alone is 2048 elements.
_ELEMS_PER_THREAD = 4
_MIN_WARPS, _MAX_WARPS = 4, 16
# An H100 has 132 SMs; fewer programs than this leaves SMs idle.
_MIN_PROGRAMS = 128


def rope_cos_sin_cache(
    head_dim: int, max_position: int, theta: float, dtype=jnp.float32, *,
    inv_freq: np.ndarray | None = None, attention_factor: float = 1.0,
) -> jax.Array:
    """[max_position, head_dim]: first half cos(pos * inv_freq), second half sin(pos * inv_freq),
    both times `attention_factor`.

    inv_freq defaults to theta ** (-arange(0, head_dim, 2) / head_dim), the Hugging Face
    default; a scaled RoPE passes its own ([head_dim / 2]).
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    # Built on the host with numpy (it is a constant) and in float64, then rounded once. Hugging
    # Face and vLLM form the angle in float32, whose rounding grows with the position (one
    # float32 ulp of a 32k-radian angle is ~4e-3 rad) and whose float32 `pow` differs between
    # libraries by an ulp, so no float32 recipe is reproducible bit for bit; float64 gives the
    # true rotation, the same on every platform, within float32 rounding of the table entry.
    if inv_freq is None:
        exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        inv_freq = 1.0 / (float(theta) ** exponent)
    inv_freq = np.asarray(inv_freq, np.float64)
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"inv_freq must have head_dim / 2 = {head_dim // 2} entries, got shape "
                         f"{inv_freq.shape}")
    angle = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    cache = np.concatenate([np.cos(angle), np.sin(angle)], axis=-1) * float(attention_factor)
    return jnp.asarray(cache.astype(np.float32), dtype=dtype)


# --------------------------------------------------------------------------- reference


def _rotate_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rope_reference(
    q: jax.Array, k: jax.Array, positions: jax.Array, cos_sin_cache: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Plain jax.numpy RoPE; see `rope` for the contract."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions].astype(jnp.float32)  # [T, head_dim]
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)


# --------------------------------------------------------------------------- pallas kernel


def _rotate_tile(x_ref, o_ref, cache_ref, rows, row_mask, pos, num_heads: int, heads_pad: int,
                 half: int):
    # x_ref is [T, num_heads * head_dim]. One tile row holds every head of one token, flattened
    # as (head, lane) with heads padded to a power of two (Triton needs power-of-two tensors
    # and Qwen2 has 14/12/28 heads); padded heads are masked out of the load and the store.
    col = jnp.arange(heads_pad * half)
    head = col // half
    lane = col % half
    first = head * (2 * half) + lane  # column of x1; x2 sits `half` further on
    mask = row_mask[:, None] & (head < num_heads)[None, :]
    i1 = (rows[:, None], first[None, :])
    i2 = (rows[:, None], first[None, :] + half)
    x1 = plgpu.load(x_ref.at[i1], mask=mask, other=0.0).astype(jnp.float32)
    x2 = plgpu.load(x_ref.at[i2], mask=mask, other=0.0).astype(jnp.float32)
    # cos/sin are loaded straight at the tile's (token, head, lane) shape: the Triton lowering
    # has no gather to tile a [rows, half] value across heads, and the repeated reads of one
    # cache row per token hit L1.
    c_idx = (pos[:, None], lane[None, :])
    s_idx = (pos[:, None], lane[None, :] + half)
    c = plgpu.load(cache_ref.at[c_idx], mask=mask, other=0.0).astype(jnp.float32)
    s = plgpu.load(cache_ref.at[s_idx], mask=mask, other=0.0).astype(jnp.float32)
    plgpu.store(o_ref.at[i1], (x1 * c - x2 * s).astype(o_ref.dtype), mask=mask)
    plgpu.store(o_ref.at[i2], (x2 * c + x1 * s).astype(o_ref.dtype), mask=mask)


def _rope_kernel(q_ref, k_ref, pos_ref, cache_ref, qo_ref, ko_ref, *, n_rows: int,
                 block_rows: int, num_heads: int, num_kv_heads: int, heads_pad: int,
                 kv_heads_pad: int, half: int):
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_mask = rows < n_rows
    pos = plgpu.load(pos_ref.at[rows], mask=row_mask, other=0)
    _rotate_tile(q_ref, qo_ref, cache_ref, rows, row_mask, pos, num_heads, heads_pad, half)
    _rotate_tile(k_ref, ko_ref, cache_ref, rows, row_mask, pos, num_kv_heads, kv_heads_pad,
                 half)


def _rope_pallas(q: jax.Array, k: jax.Array, positions: jax.Array, cache: jax.Array,
                 interpret: bool) -> tuple[jax.Array, jax.Array]:
    n_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"pallas rope needs head_dim / 2 a power of two, got {head_dim}")
    heads_pad = next_pow2(num_heads)
    kv_heads_pad = next_pow2(num_kv_heads)
    # Rows per program: as many as fit _BLOCK_ELEMS, but keep >= ~_MIN_PROGRAMS programs so a
    # decode batch (T ~ 64) still spreads over the SMs instead of a handful of programs.
    block_rows = min(max(1, _BLOCK_ELEMS // (heads_pad * half)),
                     prev_pow2(n_rows // _MIN_PROGRAMS))
    num_warps = min(_MAX_WARPS, max(_MIN_WARPS,
                                    block_rows * heads_pad * half // (32 * _ELEMS_PER_THREAD)))
    kernel = functools.partial(
        _rope_kernel, n_rows=n_rows, block_rows=block_rows, num_heads=num_heads,
        num_kv_heads=num_kv_heads, heads_pad=heads_pad, kv_heads_pad=kv_heads_pad, half=half)
    # Flattening heads into columns is a free reshape and keeps every tile 2-D.
    q2 = q.reshape(n_rows, num_heads * head_dim)
    k2 = k.reshape(n_rows, num_kv_heads * head_dim)
    qo, ko = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q2.shape, q.dtype),
                   jax.ShapeDtypeStruct(k2.shape, k.dtype)),
        grid=(pl.cdiv(n_rows, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rope",
    )(q2, k2, positions.astype(jnp.int32), cache)
    return qo.reshape(q.shape), ko.reshape(k.shape)


# --------------------------------------------------------------------------- public


def rope(
    q: jax.Array,
    k: jax.Array,
    positions: jax.Array,
    cos_sin_cache: jax.Array,
    *,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """Neox / rotate-half RoPE as in Hugging Face Qwen2 (apply_rotary_pos_emb, rotate_half).

    q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim], positions: [T] int32,
    cos_sin_cache: from `rope_cos_sin_cache`. Returns (q, k) rotated, in their input dtypes.
    Positions must lie in [0, max_position); out-of-range values are not checked.
    """
    check_backend(backend)
    if q.ndim != 3 or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rope expects q [T, H, D] and k [T, Hkv, D], got {q.shape}, {k.shape}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions shape {positions.shape} != ({q.shape[0]},)")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != q.shape[2]:
        raise ValueError(f"cos_sin_cache shape {cos_sin_cache.shape} does not match head_dim "
                         f"{q.shape[2]}")
    return _rope_jit(q, k, positions, cos_sin_cache, backend=backend)


# Jitted so eager callers (tests, benchmarks) reuse the compiled op instead of re-tracing the
# pallas_call on every call; inside the model's jit this simply inlines.
@functools.partial(jax.jit, static_argnames=("backend",))
def _rope_jit(q, k, positions, cos_sin_cache, *, backend: str):
    if backend == "reference":
        return rope_reference(q, k, positions, cos_sin_cache)
    return _rope_pallas(q, k, positions, cos_sin_cache, interpret=backend == "interpret")

