"""The model families jaxllm runs, by the Hugging Face architecture a checkpoint names
(config.json's `architectures`, or a GGUF's `general.architecture` mapped in
model_executor/config.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape
from jaxllm.model_executor.models.gemma import GemmaForCausalLM
from jaxllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from jaxllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from jaxllm.model_executor.models.granite import GraniteForCausalLM
from jaxllm.model_executor.models.llama import LlamaForCausalLM
from jaxllm.model_executor.models.mixtral import MixtralForCausalLM
from jaxllm.model_executor.models.olmo2 import Olmo2ForCausalLM
from jaxllm.model_executor.models.phi3 import Phi3ForCausalLM
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from jaxllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM
from jaxllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from jaxllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[LlamaForCausalLM]] = {
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral's decoder is Llama's, with a sliding window on every layer
    # (ModelConfig.sliding_window).
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The Flax module of an architecture; a ValueError names an unsupported one and lists
    the supported."""
    try:
        return _MODELS[architecture]
    except (KeyError, TypeError):
        raise ValueError(f"architecture {architecture!r} is not supported; jaxllm runs "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}") from None


def check_supported(config: ModelConfig) -> None:
    """A ValueError naming what of `config` no model here runs."""
    get_model_class(config.architecture)


def abstract_params(model: LlamaForCausalLM) -> dict:
    """The param tree's shapes and dtypes, without allocating anything."""
    model = model.clone(kv_groups=None)  # the params are the same in any KV layout
    cfg = model.config
    t, s = 4, 1
    attn_metadata = AttentionMetadata(
        slot_mapping=jnp.zeros((t,), jnp.int32), block_tables=jnp.zeros((s, 1), jnp.int32),
        seq_lens=jnp.zeros((s,), jnp.int32), query_start_loc=jnp.zeros((s + 1,), jnp.int32),
        logits_indices=jnp.zeros((s,), jnp.int32))
    kv = jax.ShapeDtypeStruct(kv_cache_shape(cfg, 1, 16), model.dtype)
    variables = jax.eval_shape(
        lambda kv: model.init(jax.random.PRNGKey(0), jnp.zeros((t,), jnp.int32),
                              jnp.zeros((t,), jnp.int32), kv, attn_metadata), kv)
    params = variables["params"]
    if not type(model).NORM_WEIGHT_OFFSET:
        return params

    # The loader keeps (offset + weight) norms in float32 whatever the model's dtype.
    def norm_in_float32(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        module = getattr(path[-2], "key", "") if len(path) > 1 else ""
        if str(module).endswith("norm"):
            return jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
        return leaf

    return jax.tree_util.tree_map_with_path(norm_in_float32, params)
