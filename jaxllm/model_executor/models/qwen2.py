"""Qwen2 (Qwen2ForCausalLM: Qwen2, Qwen2.5 and their Coder and Math models): Llama's decoder
with biases on the q, k and v projections, which its configs leave implicit
(`ModelConfig.from_hf_config` sets `attention_bias` for it)."""

from __future__ import annotations

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
