"""Gemma 2 (Gemma2ForCausalLM): Gemma's decoder with four norms per layer (the attention's and
the MLP's outputs normed before they join the residual stream), q.k scaled by
query_pre_attn_scalar ** -0.5, attention logits and final logits soft-capped
(cap * tanh(x / cap); ModelConfig.attn_logit_softcapping, final_logit_softcapping), and a
sliding window on every other layer (`layer_types`)."""

from __future__ import annotations

from typing import ClassVar

from jaxllm.model_executor.models.gemma import GemmaForCausalLM


class Gemma2ForCausalLM(GemmaForCausalLM):
    SANDWICH_NORM: ClassVar[bool] = True
