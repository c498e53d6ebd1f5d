"""Write this step's K/V into the paged cache.

Cache layout (shared by the model, the engine and ``paged_attention``)::

    kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]   (0 = K, 1 = V)

Slot ``s`` is block ``s // block_size``, offset ``s % block_size``; slot ``-1`` marks a padding
token that must not be written. The public function takes the whole stacked cache and a
``layer`` (a Python int or a traced scalar) so that no per-layer slice is materialized, and
returns the updated cache; when the cache is donated to the enclosing jit, both backends update
it in place (the reference through an XLA scatter that reuses the donated buffer, the kernel
through ``input_output_aliases``). The kernel reads the layer from an operand, so one Triton
module serves every layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    check_backend,
    check_layer,
    layer_operand,
    next_pow2,
    whole_block_spec,
)


def write_kv_reference(kv_cache: jax.Array, layer: int | jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array) -> jax.Array:
    layer = check_layer(layer, kv_cache.shape[0])
    num_blocks, block_size = kv_cache.shape[3], kv_cache.shape[4]
    slot_mapping = slot_mapping.astype(jnp.int32)
    if k.shape[0] == 1:
        # XLA rewrites a one-index scatter into a dynamic-update-slice fused with a select, and
        # then copies the whole cache around it when attention reads the cache in between
        # (dozens of cache copies per step: docs/perf/cpu-step.md). A second,
        # dropped padding row keeps it a real scatter, updated in place.
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), -1, jnp.int32)])
    # A negative block index would wrap around to the last block, so padding slots are sent to
    # block `num_blocks` instead, which mode="drop" discards.
    blk = jnp.where(slot_mapping < 0, num_blocks, slot_mapping // block_size)
    off = jnp.where(slot_mapping < 0, 0, slot_mapping % block_size)
    # The scalar `layer` and the arrays blk/off are advanced indices separated by slices, so the
    # indexed view has the shape [T, 2, num_kv_heads, head_dim]: K and V go in with one scatter.
    kv = jnp.stack([k, v], axis=1).astype(kv_cache.dtype)
    return kv_cache.at[layer, :, :, blk, off].set(kv, mode="drop")


def _write_kv_kernel(layer_ref, slot_ref, k_ref, v_ref, cache_in_ref, cache_ref, *,
                     block_tokens: int):
    del cache_in_ref  # aliased with cache_ref: the cache is only touched through the output
    num_tokens, _, head_dim = k_ref.shape
    num_blocks, block_size, _ = cache_ref.shape[2:]
    layer = layer_ref[0]
    h = pl.program_id(1)
    t = pl.program_id(0) * block_tokens + jnp.arange(block_tokens)
    in_range = t < num_tokens
    slot = plgpu.load(slot_ref.at[jnp.minimum(t, num_tokens - 1)], mask=in_range, other=-1)
    ok = in_range & (slot >= 0)
    # Skipped tokens point one block past the end: masked lanes never store on GPU, and the
    # interpreter drops out-of-bounds scatter indices instead of letting them alias a real slot.
    blk = jnp.where(ok, slot // block_size, num_blocks)[:, None]
    off = jnp.where(ok, slot % block_size, 0)[:, None]
    d = jnp.arange(head_dim)[None, :]
    tok = jnp.minimum(t, num_tokens - 1)[:, None]
    mask = ok[:, None]
    for which, src in ((0, k_ref), (1, v_ref)):
        rows = plgpu.load(src.at[tok, h, d], mask=mask, other=0.0)
        plgpu.store(cache_ref.at[layer, which, blk, off, d], rows.astype(cache_ref.dtype),
                    mask=mask)


def _write_kv_pallas(kv_cache: jax.Array, layer: int | jax.Array, k: jax.Array, v: jax.Array,
                     slot_mapping: jax.Array, *, interpret: bool) -> jax.Array:
    num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    # A tile of tokens per program: each token lands in its own (data-dependent) block, so the
    # tile is a gather-scatter of [block_tokens, head_dim] rows; 16 keeps it a power of two.
    block_tokens = min(16, next_pow2(num_tokens))
    grid = (pl.cdiv(num_tokens, block_tokens), num_kv_heads)

    # Each program sees K and V of one KV head in every layer,
    # [num_layers, 2, num_blocks, bs, head_dim], and picks the layer from the layer operand.
    cache_spec = pl.BlockSpec((num_layers, 2, None, num_blocks, block_size, head_dim),
                              lambda i, h: (0, 0, h, 0, 0, 0))
    return pl.pallas_call(
        functools.partial(_write_kv_kernel, block_tokens=block_tokens),
        grid=grid,
        in_specs=[whole_block_spec((1,)), whole_block_spec(slot_mapping.shape),
                  whole_block_spec(k.shape), whole_block_spec(v.shape), cache_spec],
        out_specs=cache_spec,
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        # Layers and slots this call does not write keep their contents: the output is the
        # donated input buffer itself.
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1 if head_dim <= 64 else 2,
                                             num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(layer_operand(layer, num_layers), slot_mapping.astype(jnp.int32), k, v, kv_cache)


def write_kv(kv_cache: jax.Array, layer: int | jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array, *, backend: str = "reference") -> jax.Array:
    """Scatter this step's K/V into layer ``layer`` of the paged cache.

    layer: a Python int, or a scalar (or one-element) integer array, traced or not.
    k, v: [T, num_kv_heads, head_dim]; slot_mapping: [T] int32, -1 = padding token, not written.
    Returns the updated kv_cache. It is in place when kv_cache is donated to the enclosing jit
    (reference: an XLA scatter with mode="drop"; pallas: input_output_aliases).
    """
    check_backend(backend)
    if backend == "reference":
        return write_kv_reference(kv_cache, layer, k, v, slot_mapping)
    return _write_kv_pallas(kv_cache, layer, k, v, slot_mapping,
                            interpret=backend == "interpret")

