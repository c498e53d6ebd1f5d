"""The device step and the prompt-logprob statistics as plain functions of the model, so the
runner and the lowering checks (jaxllm/distributed/check_tp_lowering.py) build the same
program. With a mesh (a `Mesh`, or an `AbstractMesh` for lowering without devices) each is one
SPMD program under `jax.shard_map` (jaxllm/distributed/tensor_parallel.py)."""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.distributed.tensor_parallel import (
    KV_SPEC,
    LOGITS_SPEC,
    TP_AXIS,
    merged_top_k,
    sharded_target_stats,
    spmd,
)
from jaxllm.model_executor.layers.attention import AttentionMetadata
from jaxllm.model_executor.layers.logits import compute_logits
from jaxllm.model_executor.models.llama import LlamaForCausalLM
from jaxllm.sample.topk import top_k_logits


def _top_k(logits: jax.Array, k: int, mesh: Any):
    return top_k_logits(logits, k) if mesh is None else merged_top_k(logits, k, TP_AXIS)


# (top-K values, ids, log-sum-exp; logits; hidden states; KV array), see `forward_step`.
StepOutputs = tuple[jax.Array | None, jax.Array | None, jax.Array | None, jax.Array, jax.Array,
                    jax.Array]


def forward_step(model: LlamaForCausalLM, top_k: int, mesh: Any, params: dict, rope: dict,
                 kv_cache: jax.Array, input_ids: jax.Array, positions: jax.Array,
                 attn_metadata: AttentionMetadata[jax.Array], max_query_len: int | None,
                 num_splits: int) -> StepOutputs:
    """(top-K values, ids, log-sum-exp or three Nones when top_k is 0; logits [R, vocab]
    (vocabulary-sharded with a mesh); hidden states [T, hidden]; the updated KV array)."""
    def body(params, rope, input_ids, positions, attn_metadata, kv_cache) -> StepOutputs:
        # flax annotates apply for mutable collections too ((output, variables)); none here.
        logits, hidden, kv_cache = cast(tuple[jax.Array, jax.Array, jax.Array], model.apply(
            {"params": params, "rope": rope}, input_ids, positions, kv_cache, attn_metadata,
            max_query_len=max_query_len, num_splits=num_splits))
        if not top_k:
            return None, None, None, logits, hidden, kv_cache
        values, token_ids, lse = _top_k(logits, top_k, mesh)
        return values, token_ids, lse, logits, hidden, kv_cache

    step = body if mesh is None else spmd(
        body, mesh, params, (P(), P(), P(), LOGITS_SPEC, P(), KV_SPEC), extra_in_specs=(KV_SPEC,))
    return step(params, rope, input_ids, positions, attn_metadata, kv_cache)


def prompt_stats(model: LlamaForCausalLM, num_top: int, mesh: Any, params: dict,
                 hidden: jax.Array, rows: jax.Array, targets: jax.Array
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Of the hidden-state rows `rows`: (the target token's logit, its rank, the top `num_top`
    values and ids, log-sum-exp)."""
    def body(params, hidden, rows, targets):
        logits = compute_logits(params, model.config, jnp.take(hidden, rows, axis=0),
                                model.kernel_backend, model.gemv_kernel_rows)
        if mesh is None:
            target = jnp.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
            rank = 1 + jnp.sum(logits > target[:, None], axis=1, dtype=jnp.int32)
        else:
            target, rank = sharded_target_stats(logits, targets, TP_AXIS)
        values, ids, lse = _top_k(logits, num_top, mesh)
        return target, rank, values, ids, lse

    stats = body if mesh is None else spmd(body, mesh, params, P())
    return stats(params, hidden, rows, targets)
