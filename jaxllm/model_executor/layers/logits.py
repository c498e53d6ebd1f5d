"""The vocabulary's two ends: the token embedding lookup and the LM head (logits), each
vocabulary-parallel under tensor parallelism (each device holds its slice of the rows)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxllm.distributed.tensor_parallel import vocab_parallel_embed
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.linear import linear
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, dequantize


def embed_tokens(embed: jax.Array | GGUFWeight, input_ids: jax.Array, dtype: Any,
                 tp_axis: str | None = None) -> jax.Array:
    """[T, hidden] rows of the embedding table in `dtype`; a GGUF table kept quantized
    dequantizes only the step's rows."""
    if isinstance(embed, GGUFWeight):
        return dequantize(embed, input_ids).astype(dtype)
    if tp_axis is not None:
        return vocab_parallel_embed(embed, input_ids, tp_axis).astype(dtype)
    return jnp.take(embed, input_ids, axis=0).astype(dtype)


def compute_logits(params: Mapping[str, Any], config: ModelConfig, hidden_states: jax.Array,
                   backend: str = "reference", gemv_rows: int = 0) -> jax.Array:
    """LM head on already-normed hidden states: the model's last step, also used alone for
    prompt logprobs. The head is the embedding table when tied; [vocab, hidden] either way.
    Granite's logits are divided by its `logits_scaling`; with the config's
    `final_logit_softcapping` (Gemma 2) they are capped here, so that sampling and logprobs see
    them as Hugging Face's model returns them."""
    head = params["embed_tokens"] if config.tie_word_embeddings else params["lm_head"]
    logits = linear(hidden_states, head, backend, gemv_rows).astype(jnp.float32)
    if config.logits_scaling != 1:
        logits = logits / config.logits_scaling
    cap = config.final_logit_softcapping
    return logits if cap is None else cap * jnp.tanh(logits / cap)
