"""Granite (GraniteForCausalLM: IBM Granite 3.x dense): Llama's decoder scaled by its config's
multipliers (`ModelConfig.embedding_multiplier`, `residual_multiplier`, `attention_multiplier`,
`logits_scaling`), which the decoder applies where transformers does."""

from __future__ import annotations

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    pass
