"""Paged attention as a layer: RoPE and the KV write on the fused QKV output, then attention
over the paged KV array, on the implementation the runner chose once (`attention_impl`): the
Pallas kernels (GPU, or interpret mode in tests), our CPU kernel, or XLA's reference ops.
The choice is the config's (`resolve_attention_impl` in jaxllm/config.py), fitted to the
model's head size here.
"""

from __future__ import annotations

from typing import Any, Generic, NamedTuple, TypeVar, cast

import flax.linen as nn
import jax

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers import cpu_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rope_write_kv import rope_write_kv

# Arrays when a step runs; their shapes, dtypes and shardings when a step is traced ahead of time.
ArrayOrSpec = TypeVar("ArrayOrSpec", jax.Array, jax.ShapeDtypeStruct)
# The implementation names besides the kernel backends' own ("pallas", "interpret",
# "reference").
CPU_KERNEL = "cpu"


class AttentionMetadata(NamedTuple, Generic[ArrayOrSpec]):
    """What every layer needs to find its tokens' KV slots (shapes: T tokens, S sequences).
    With several KV cache groups (jaxllm/model_executor/kv_cache_groups.py) the slot mapping
    and block tables lead with a group axis, [G, T] and [G, S, max_blocks_per_seq]: each
    layer reads its group's (`for_group`)."""

    slot_mapping: ArrayOrSpec  # [T] int32, -1 for padding tokens (not written)
    block_tables: ArrayOrSpec  # [S, max_blocks_per_seq] int32
    seq_lens: ArrayOrSpec  # [S] int32, context length including this step's tokens (0 = padding)
    query_start_loc: ArrayOrSpec  # [S + 1] int32, cumulative query lengths
    logits_indices: ArrayOrSpec  # [R] int32, token rows whose logits leave the device

    def for_group(self, group: int, num_groups: int) -> AttentionMetadata[ArrayOrSpec]:
        """The metadata a layer of KV cache group `group` reads (static slices)."""
        if num_groups == 1:
            return self
        slot_mapping, block_tables = cast(Any, self.slot_mapping), cast(Any, self.block_tables)
        return self._replace(slot_mapping=slot_mapping[group], block_tables=block_tables[group])


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int,
                   num_slots: int | None = None) -> tuple[int, ...]:
    """[layers, K/V, kv_heads, blocks, block_size, head_dim]: a (head, block) tile is contiguous.
    `num_slots` layers on the first axis (KVCacheGroups.num_slots); None: every layer's own."""
    layers = config.num_hidden_layers if num_slots is None else num_slots
    return (layers, 2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)


def attention_impl(resolved: str, kernel_backend: str, head_dim: int) -> str:
    """The attention a model runs: `resolved` (EngineConfig.attention_impl), except our CPU
    kernel for a head size it does not take, which runs the kernel backend's."""
    if resolved == CPU_KERNEL and not cpu_attention.takes(head_dim):
        return kernel_backend
    return resolved


class Attention(nn.Module):
    """No params: [T, (H + 2 KVH) x D] q/k/v (plus the q/k/v bias still to add, or None) ->
    ([T, H x D] attention output, the updated KV array)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_idx: int  # the layer's index on the KV array's first axis (KVCacheGroups.layer_slot)
    backend: str  # the kernel backend (RoPE and the KV write)
    impl: str | None = None  # `attention_impl`'s choice; None: the kernel backend's
    # Keys each query sees, its own included (ModelConfig.layer_sliding_window); None: all.
    sliding_window: int | None = None
    # The scale of q.k (None: head_dim ** -0.5; Gemma's query_pre_attn_scalar ** -0.5,
    # Granite's attention_multiplier).
    scale: float | None = None
    # Scaled logits -> cap * tanh(logits / cap) before the softmax (Gemma 2); None: none.
    logits_soft_cap: float | None = None

    @nn.compact
    def __call__(self, qkv: jax.Array, bias: jax.Array | None, positions: jax.Array,
                 kv_cache: jax.Array, attn_metadata: AttentionMetadata[jax.Array],
                 cos_sin_cache: jax.Array, max_query_len: int | None, num_splits: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
        q, kv_cache = rope_write_kv(qkv, bias, positions, cos_sin_cache, kv_cache,
                                    self.layer_idx, attn_metadata.slot_mapping,
                                    num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                    backend=self.backend)
        scale = self.head_dim ** -0.5 if self.scale is None else self.scale
        if self.impl == CPU_KERNEL:
            out = cpu_attention.paged_attention(
                q, kv_cache, self.layer_idx, attn_metadata.block_tables,
                attn_metadata.seq_lens, attn_metadata.query_start_loc, scale=scale,
                sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)
        else:
            out = paged_attention(
                q, kv_cache, self.layer_idx, attn_metadata.block_tables,
                attn_metadata.seq_lens, attn_metadata.query_start_loc, scale=scale,
                max_query_len=max_query_len, backend=self.impl or self.backend,
                num_splits=num_splits, sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap)
        return out.reshape(-1, self.num_heads * self.head_dim), kv_cache
