"""Qwen3 (Qwen3ForCausalLM): Llama's decoder with an RMSNorm over each head of q and of k
before RoPE (params `q_norm`, `k_norm` [head_dim] per layer), and no q/k/v biases unless its
config's `attention_bias` says so."""

from __future__ import annotations

from typing import ClassVar

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM: ClassVar[bool] = True
