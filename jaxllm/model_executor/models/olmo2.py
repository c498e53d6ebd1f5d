"""OLMo 2 (Olmo2ForCausalLM): Llama's decoder with no pre-norms, each sublayer's output normed
before it joins the residual stream (params `post_attention_layernorm`,
`post_feedforward_layernorm`), and RMSNorms over the whole q and k projections before RoPE
(params `q_proj_norm`, `k_proj_norm`: all heads at once, unlike Qwen3's per-head norms)."""

from __future__ import annotations

from typing import ClassVar

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class Olmo2ForCausalLM(LlamaForCausalLM):
    POST_NORM: ClassVar[bool] = True
    PROJECTION_QK_NORM: ClassVar[bool] = True
