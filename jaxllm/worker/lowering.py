"""The runner's step (jaxllm/worker/step.py) on one device with the Pallas kernels, lowered for
CUDA from abstract inputs (weights as shapes only), with no GPU: what the Triton module counts
and lowering checks read. The tensor-parallel step's counterpart is
jaxllm/distributed/check_tp_lowering.py."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.config import resolve_lora_skip_unused_slots
from jaxllm.lora.layers import apply_lora
from jaxllm.lora.slots import LoRASlots
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.kv_cache_groups import kv_cache_groups
from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.models.registry import abstract_params, get_model_class
from jaxllm.worker.step import forward_step
from pallas_kernels.attention_common import decode_num_splits
from pallas_kernels.common import lower_for_cuda


def lower_step_for_cuda(config: ModelConfig, num_tokens: int, decode: bool, *,
                        query_len: int = 1, dtype: Any = jnp.bfloat16, block_size: int = 16,
                        num_blocks: int = 4096, max_model_len: int = 4096,
                        max_num_seqs: int = 64, lora: tuple[int, int] | None = None,
                        hybrid_kv_cache: bool = True) -> jax.stages.Lowered:
    """The runner's step with the Pallas kernels, lowered for CUDA from abstract inputs: a
    decode bucket of `num_tokens` sequences (split-K attention as the runner sizes it), a
    speculative-decoding verify bucket (`decode` with `query_len` 1 + k: num_tokens / query_len
    sequences of query_len tokens, max_query_len query_len, a logits row per token, unsplit
    attention) or a prefill bucket of `num_tokens` tokens. `lora` (max_loras, max_lora_rank):
    with the LoRA adapters' slots, as an engine with enable_lora runs it. The KV array and
    block tables are laid out in the model's KV cache groups as an engine with
    `hybrid_kv_cache` lays them out."""
    if query_len < 1 or num_tokens % query_len or (query_len > 1 and not decode):
        raise ValueError(f"query_len must be >= 1, divide num_tokens ({num_tokens}) and be 1 "
                         f"for a prefill bucket, got {query_len} (decode={decode})")
    groups = kv_cache_groups(config, max_model_len, hybrid_kv_cache)
    model = get_model_class(config.architecture)(config, dtype=dtype, kernel_backend="pallas",
                                                 kv_groups=groups)
    if query_len > 1 and num_tokens // query_len > max_num_seqs:
        raise ValueError(f"a verify bucket of {num_tokens} tokens holds "
                         f"{num_tokens // query_len} sequences, more than max_num_seqs "
                         f"({max_num_seqs})")
    seqs = min(num_tokens // query_len, max_num_seqs)
    rows = seqs * query_len if decode else seqs

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    g = () if groups.num_groups == 1 else (groups.num_groups,)
    attn_metadata = AttentionMetadata(i32(*g, num_tokens),
                                      i32(*g, seqs, -(-max_model_len // block_size)),
                                      i32(seqs), i32(seqs + 1), i32(rows))
    splits = (decode_num_splits(config.max_attended_keys(max_model_len), seqs,
                                config.num_key_value_heads)
              if decode and query_len == 1 else 1)
    fn = functools.partial(forward_step, model, 0, None,
                           max_query_len=query_len if decode else num_tokens, num_splits=splits)
    kv = jax.ShapeDtypeStruct(kv_cache_shape(config, num_blocks, block_size, groups.num_slots),
                              dtype)
    rope = jax.eval_shape(lambda: rope_variables(config))
    args = (abstract_params(model), rope, kv, i32(num_tokens), i32(num_tokens), attn_metadata)
    if lora is None:
        return lower_for_cuda(fn, args, donate_argnums=2)
    slots = LoRASlots(config, *lora, dtype)

    def with_lora(params, rope, kv, input_ids, positions, attn_metadata, weights, token_slots):
        # A GPU's step computes every slot (config.resolve_lora_skip_unused_slots).
        with apply_lora(weights, token_slots, slots.num_slots,
                        skip_unused_slots=resolve_lora_skip_unused_slots("gpu")):
            return fn(params, rope, kv, input_ids, positions, attn_metadata)

    return lower_for_cuda(with_lora, (*args, slots.abstract(), i32(num_tokens)),
                          donate_argnums=2)
