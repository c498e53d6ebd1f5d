"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases, as `qkv_bias` says) over a mixture-of-experts feed-forward with a shared expert whose
output a sigmoid `shared_expert_gate` scales (layers/fused_moe.py); layers in `mlp_only_layers`
or off `decoder_sparse_step` keep a dense MLP of `intermediate_size`."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn

from jaxllm.model_executor.layers.fused_moe import moe_or_dense
from jaxllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    def mlp_class(self, layer_idx: int) -> Callable[..., nn.Module]:
        return moe_or_dense(self.config, layer_idx, LlamaMLP)
