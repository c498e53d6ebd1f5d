"""Phi-3 (Phi3ForCausalLM: Phi-3, Phi-3.5, Phi-4, Phi-4-mini): Llama's decoder, its q/k/v and
gate/up stored fused on disk (`qkv_proj`, `gate_up_proj`, as our params are), RoPE on part of
each head where `partial_rotary_factor` says (layers/rotary_embedding.py), longrope scaling, and
the `sliding_window` its config names on every layer."""

from __future__ import annotations

from jaxllm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
