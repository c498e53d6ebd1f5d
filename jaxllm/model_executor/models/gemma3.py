"""Gemma 3's text model (Gemma3ForCausalLM, config model_type "gemma3_text"): Gemma 2's
decoder with Gemma's per-head RMSNorm of q and k before RoPE, no attention soft cap, five
sliding-window layers to one global by default, and the sliding layers' own RoPE base
(ModelConfig.rope_local_theta; the global layers' may carry a linear scaling)."""

from __future__ import annotations

from typing import ClassVar

from jaxllm.model_executor.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    QK_NORM: ClassVar[bool] = True
