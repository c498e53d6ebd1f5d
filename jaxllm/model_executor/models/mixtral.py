"""Mixtral (MixtralForCausalLM): Mistral's decoder with every layer's feed-forward a mixture of
`num_local_experts` experts of `intermediate_size`, the top-k probabilities always renormalized
(layers/fused_moe.py). Checkpoints name the block `block_sparse_moe` and the experts' weights
w1 (gate), w3 (up), w2 (down); the loader maps them."""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn

from jaxllm.model_executor.layers.fused_moe import moe_or_dense
from jaxllm.model_executor.models.llama import LlamaForCausalLM, LlamaMLP


class MixtralForCausalLM(LlamaForCausalLM):
    def mlp_class(self, layer_idx: int) -> Callable[..., nn.Module]:
        return moe_or_dense(self.config, layer_idx, LlamaMLP)
