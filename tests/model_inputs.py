"""Builds paged-attention inputs for a batch of whole prompts (contiguous block runs), and a
model's logits over such a batch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape


def prefill_inputs(config, prompts: list[list[int]], block_size: int = 16, dtype=jnp.float32):
    """(input_ids, positions, kv_cache, metadata) with logits for every token of every prompt."""
    lens = [len(p) for p in prompts]
    per_seq = -(-max(lens) // block_size)
    block_tables = np.arange(len(prompts) * per_seq, dtype=np.int32).reshape(len(prompts), -1)
    # Scramble physical blocks so logical order != physical order.
    perm = np.random.default_rng(0).permutation(block_tables.size).astype(np.int32)
    block_tables = perm[block_tables]
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    seq_ids = np.repeat(np.arange(len(prompts)), lens)
    slots = block_tables[seq_ids, positions // block_size] * block_size + positions % block_size
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), block_tables=jnp.asarray(block_tables),
        seq_lens=jnp.asarray(lens, jnp.int32), query_start_loc=jnp.asarray(qsl),
        logits_indices=jnp.arange(int(qsl[-1]), dtype=jnp.int32))
    kv = jnp.zeros(kv_cache_shape(config, block_tables.size, block_size), dtype)
    ids = jnp.asarray(np.concatenate(prompts), jnp.int32)
    return ids, jnp.asarray(positions), kv, md


def prefill_logits(loaded, prompts: list[list[int]], **model_kw) -> list[np.ndarray]:
    """The registry's class for a loaded checkpoint's architecture (`model_kw`: its fields,
    e.g. kernel_backend), applied to a batch of whole prompts: per-prompt logits of every
    token."""
    from jaxllm.model_executor.layers.rotary_embedding import rope_variables
    from jaxllm.model_executor.models.registry import get_model_class

    model = get_model_class(loaded.config.architecture)(loaded.config, **model_kw)
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    logits, _, _ = model.apply({"params": loaded.params, "rope": rope_variables(loaded.config)},
                               ids, pos, kv, md)
    logits = np.asarray(logits)
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    return [logits[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
