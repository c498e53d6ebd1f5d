"""The QKV projection's epilogue in one kernel: bias, RoPE on q and k, and the KV write.

The attention block between its QKV matmul and paged attention would otherwise launch a bias
add, a RoPE kernel and a KV-write kernel per layer, each reading what the one before wrote.
Here one program per tile of tokens reads each token's q, k and v once from the matmul's output
[T, (H + 2 Hkv) x D], adds the bias, rotates q and k (neox / rotate-half, as Hugging Face
Qwen2) and writes the rotated q out and the rotated k and v straight into the paged cache
(layout of ``kv_write``; slot -1 = padding, not written). The rotated k is never written
elsewhere: attention reads it from the cache.

One public function, `rope_write_kv`, picks the implementation:
  "pallas"    the Triton-backed Pallas kernel (GPU),
  "interpret" the same pallas_call in interpret mode (CPU, for tests),
  "reference" bias add, `rope_reference` and `write_kv_reference` in plain XLA.
The cache is updated in place when it is donated to the enclosing jit (the kernel aliases it;
the reference scatters into it). The layer comes from an operand, so one Triton module serves
every layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    check_backend,
    layer_operand,
    next_pow2,
    prev_pow2,
    whole_block_spec,
)
from pallas_kernels.kv_write import write_kv_reference
from pallas_kernels.rope import rope_reference

# Tile sizing as the RoPE kernel's: elements of one half head per program, elements per thread
# of each live tile, at least this many programs for a decode batch.
_BLOCK_ELEMS = 2048
_ELEMS_PER_THREAD = 4
_MIN_WARPS, _MAX_WARPS = 4, 16
_MIN_PROGRAMS = 128


def _split(qkv: jax.Array, num_heads: int, num_kv_heads: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    t, width = qkv.shape
    head_dim = width // (num_heads + 2 * num_kv_heads)
    q, k, v = jnp.split(qkv, [num_heads * head_dim, (num_heads + num_kv_heads) * head_dim],
                        axis=-1)
    return (q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
            v.reshape(t, num_kv_heads, head_dim))


def rope_write_kv_reference(qkv: jax.Array, bias: jax.Array | None, positions: jax.Array,
                            cos_sin_cache: jax.Array, kv_cache: jax.Array,
                            layer: int | jax.Array, slot_mapping: jax.Array, *,
                            num_heads: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    if bias is not None:
        qkv = qkv + bias
    q, k, v = _split(qkv, num_heads, num_kv_heads)
    q, k = rope_reference(q, k, positions, cos_sin_cache)
    return q, write_kv_reference(kv_cache, layer, k, v, slot_mapping)


# --------------------------------------------------------------------------- pallas kernel


def _load_part(qkv_ref, bias_ref, rows, cols, mask):
    x = plgpu.load(qkv_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0.0)
    x = x.astype(jnp.float32)
    if bias_ref is not None:
        b = plgpu.load(bias_ref.at[cols], mask=cols < bias_ref.shape[0], other=0.0)
        x = x + b.astype(jnp.float32)[None, :]
    return x


def _kernel(layer_ref, pos_ref, slot_ref, qkv_ref, *refs, has_bias: bool, n_rows: int,
            block_rows: int, num_heads: int, num_kv_heads: int, heads_pad: int,
            kv_heads_pad: int, half: int):
    if has_bias:
        bias_ref, cos_sin_ref, _cache_in, q_ref, cache_out = refs
    else:
        bias_ref = None
        cos_sin_ref, _cache_in, q_ref, cache_out = refs
    del _cache_in  # aliased with cache_out: the cache is only touched through the output
    num_blocks, block_size = cache_out.shape[3], cache_out.shape[4]
    head_dim = 2 * half
    layer = layer_ref[0]
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    row_mask = rows < n_rows
    # Rows past the end read the last row (masked) and store one row past the end: the
    # interpreter drops such scatter indices, where a clamped index would race the real row.
    store_rows = jnp.where(row_mask, rows, n_rows)
    rows = jnp.minimum(rows, n_rows - 1)
    pos = plgpu.load(pos_ref.at[rows], mask=row_mask, other=0)

    def rotate(cols_first, lane, mask):
        # x1 at cols_first, x2 `half` further on; cos/sin loaded at the tile's shape (the
        # Triton lowering has no gather to tile a per-token row across heads).
        x1 = _load_part(qkv_ref, bias_ref, rows, cols_first, mask)
        x2 = _load_part(qkv_ref, bias_ref, rows, cols_first + half, mask)
        c = plgpu.load(cos_sin_ref.at[pos[:, None], lane[None, :]], mask=mask, other=0.0)
        s = plgpu.load(cos_sin_ref.at[pos[:, None], lane[None, :] + half], mask=mask,
                       other=0.0)
        c, s = c.astype(jnp.float32), s.astype(jnp.float32)
        return x1 * c - x2 * s, x2 * c + x1 * s

    # q: every head of each token in one [rows, heads x half] tile, padded heads masked.
    col = jnp.arange(heads_pad * half)
    head, lane = col // half, col % half
    mask = row_mask[:, None] & (head < num_heads)[None, :]
    o1, o2 = rotate(head * head_dim + lane, lane, mask)
    first = head * head_dim + lane
    plgpu.store(q_ref.at[store_rows[:, None], first[None, :]], o1.astype(q_ref.dtype),
                mask=mask)
    plgpu.store(q_ref.at[store_rows[:, None], first[None, :] + half], o2.astype(q_ref.dtype),
                mask=mask)

    # k and v: into the cache at each token's slot; padding tokens (slot -1) and rows past the
    # end point one block past the last (masked lanes never store on a GPU; the interpreter
    # drops out-of-bounds scatter indices instead of letting them alias a real slot).
    slot = plgpu.load(slot_ref.at[rows], mask=row_mask, other=-1)
    ok = row_mask & (slot >= 0)
    blk = jnp.where(ok, slot // block_size, num_blocks)[:, None]
    off = jnp.where(ok, slot % block_size, 0)[:, None]
    col = jnp.arange(kv_heads_pad * half)
    head, lane = col // half, col % half
    mask = ok[:, None] & (head < num_kv_heads)[None, :]
    k_first = num_heads * head_dim + head * head_dim + lane
    k1, k2 = rotate(k_first, lane, mask)
    h = head[None, :]
    out_dtype = cache_out.dtype
    plgpu.store(cache_out.at[layer, 0, h, blk, off, lane[None, :]], k1.astype(out_dtype),
                mask=mask)
    plgpu.store(cache_out.at[layer, 0, h, blk, off, lane[None, :] + half],
                k2.astype(out_dtype), mask=mask)
    v_first = (num_heads + num_kv_heads) * head_dim + head * head_dim + lane
    for shift in (0, half):
        v = _load_part(qkv_ref, bias_ref, rows, v_first + shift, mask)
        plgpu.store(cache_out.at[layer, 1, h, blk, off, lane[None, :] + shift],
                    v.astype(out_dtype), mask=mask)


def _rope_write_kv_pallas(qkv: jax.Array, bias: jax.Array | None, positions: jax.Array,
                          cos_sin_cache: jax.Array, kv_cache: jax.Array,
                          layer: int | jax.Array, slot_mapping: jax.Array, *, num_heads: int,
                          num_kv_heads: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    n_rows = qkv.shape[0]
    head_dim = kv_cache.shape[-1]
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"pallas rope_write_kv needs head_dim / 2 a power of two, got "
                         f"{head_dim}")
    heads_pad, kv_heads_pad = next_pow2(num_heads), next_pow2(num_kv_heads)
    block_rows = min(max(1, _BLOCK_ELEMS // (heads_pad * half)),
                     prev_pow2(n_rows // _MIN_PROGRAMS))
    num_warps = min(_MAX_WARPS, max(_MIN_WARPS,
                                    block_rows * heads_pad * half // (32 * _ELEMS_PER_THREAD)))
    kernel = functools.partial(
        _kernel, has_bias=bias is not None, n_rows=n_rows, block_rows=block_rows,
        num_heads=num_heads, num_kv_heads=num_kv_heads, heads_pad=heads_pad,
        kv_heads_pad=kv_heads_pad, half=half)
    operands = [layer_operand(layer, kv_cache.shape[0]), positions.astype(jnp.int32),
                slot_mapping.astype(jnp.int32), qkv]
    if bias is not None:
        operands.append(bias)
    operands += [cos_sin_cache, kv_cache]
    cache_index = len(operands) - 1
    q, kv_cache = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_rows, block_rows),),
        in_specs=[whole_block_spec(x.shape) for x in operands],
        out_specs=[whole_block_spec((n_rows, num_heads * head_dim)),
                   whole_block_spec(kv_cache.shape)],
        out_shape=(jax.ShapeDtypeStruct((n_rows, num_heads * head_dim), qkv.dtype),
                   jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
        # Slots this call does not write keep their contents: the output is the donated input.
        input_output_aliases={cache_index: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="rope_write_kv",
    )(*operands)
    return q.reshape(n_rows, num_heads, head_dim), kv_cache


# --------------------------------------------------------------------------- public


def rope_write_kv(qkv: jax.Array, bias: jax.Array | None, positions: jax.Array,
                  cos_sin_cache: jax.Array, kv_cache: jax.Array, layer: int | jax.Array,
                  slot_mapping: jax.Array, *, num_heads: int, num_kv_heads: int,
                  backend: str = "reference") -> tuple[jax.Array, jax.Array]:
    """qkv: [T, (num_heads + 2 num_kv_heads) x head_dim], the QKV matmul's output; bias: its
    [width] bias still to add, or None; positions, slot_mapping: [T] int32; cos_sin_cache: from
    `rope.rope_cos_sin_cache`; kv_cache: [layers, 2, num_kv_heads, blocks, block_size, head_dim].
    Returns (q rotated [T, num_heads, head_dim] in qkv's dtype, kv_cache with this step's
    rotated K and V in layer `layer`)."""
    check_backend(backend)
    head_dim = kv_cache.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.ndim != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv shape {qkv.shape} != [T, {width}] for {num_heads} heads and "
                         f"{num_kv_heads} KV heads of {head_dim}")
    if bias is not None and bias.shape != (width,):
        raise ValueError(f"bias shape {bias.shape} != ({width},)")
    if kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"kv_cache has {kv_cache.shape[2]} KV heads, not {num_kv_heads}")
    if positions.shape != (qkv.shape[0],) or slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"positions {positions.shape} and slot_mapping {slot_mapping.shape} "
                         f"must be ({qkv.shape[0]},)")
    if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache shape {cos_sin_cache.shape} does not match head_dim "
                         f"{head_dim}")
    if backend == "reference":
        return rope_write_kv_reference(qkv, bias, positions, cos_sin_cache, kv_cache, layer,
                                       slot_mapping, num_heads=num_heads,
                                       num_kv_heads=num_kv_heads)
    return _rope_write_kv_pallas(qkv, bias, positions, cos_sin_cache, kv_cache, layer,
                                 slot_mapping, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 interpret=backend == "interpret")
