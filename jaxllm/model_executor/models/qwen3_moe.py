"""Qwen3-MoE (Qwen3MoeForCausalLM, e.g. Qwen3-30B-A3B): Qwen3's attention (per-head q/k
RMSNorm) over a mixture-of-experts feed-forward without a shared expert
(layers/fused_moe.py), its top-k probabilities renormalized as `norm_topk_prob` says; layers in
`mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn

from jaxllm.model_executor.layers.fused_moe import moe_or_dense
from jaxllm.model_executor.models.llama import LlamaMLP
from jaxllm.model_executor.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def mlp_class(self, layer_idx: int) -> Callable[..., nn.Module]:
        return moe_or_dense(self.config, layer_idx, LlamaMLP)
