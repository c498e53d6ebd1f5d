"""Gemma (GemmaForCausalLM): Llama's decoder with Gemma's RMSNorm, which scales by
(1 + weight) (the loader adds the one, `NORM_WEIGHT_OFFSET`), embeddings scaled by
sqrt(hidden_size) and tied to the LM head, and a GeGLU MLP (GELU's tanh approximation)."""

from __future__ import annotations

from typing import ClassVar

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    NORM_WEIGHT_OFFSET: ClassVar[float] = 1.0
    EMBED_SCALE: ClassVar[bool] = True
