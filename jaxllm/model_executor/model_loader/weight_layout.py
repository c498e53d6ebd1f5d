"""Where a checkpoint's layer weights go in our params, as plain numpy (what the loaders and
the LoRA adapter reader share; no JAX, so a frontend checking an adapter stays light): the HF
tensors stacked into each fused projection, and the rows partial rotary reorders.
"""

from __future__ import annotations

import numpy as np

from jaxllm.model_executor.config import ModelConfig

# Fused param -> the HF names of its parts, stacked along rows as the dense loader stacks them.
_LAYER_WEIGHTS = {
    ("self_attn", "qkv_proj"): [f"self_attn.{x}_proj.weight" for x in "qkv"],
    ("self_attn", "o_proj"): ["self_attn.o_proj.weight"],
    ("mlp", "gate_up_proj"): ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    ("mlp", "down_proj"): ["mlp.down_proj.weight"],
}
# Architectures whose checkpoints store q/k/v and gate/up fused, in our params' order.
FUSED_ON_DISK = ("Phi3ForCausalLM",)


def layer_weights(config: ModelConfig) -> dict[tuple[str, str], list[str]]:
    """A dense decoder layer's weight matrices -> the HF names (after `layers.{i}.`) of the
    tensors stacked into each."""
    if config.architecture not in FUSED_ON_DISK:
        return _LAYER_WEIGHTS
    return {**_LAYER_WEIGHTS, ("self_attn", "qkv_proj"): ["self_attn.qkv_proj.weight"],
            ("mlp", "gate_up_proj"): ["mlp.gate_up_proj.weight"]}


def rotary_head_order(config: ModelConfig) -> np.ndarray | None:
    """The dims of one q or k head in the order the kernels rotate them, as indices into
    Hugging Face's order ([rotated first half, passed first half, rotated second half, passed
    second half]); None with RoPE on the whole head."""
    head, rot = config.head_dim, config.rotary_dim
    if rot == head:
        return None
    half, passed = rot // 2, (head - rot) // 2
    return np.concatenate([np.arange(half), rot + np.arange(passed), half + np.arange(half),
                           rot + passed + np.arange(passed)])


def rotary_row_order(config: ModelConfig, hf_name: str) -> np.ndarray | None:
    """Rows of a q or k weight (or Phi-3's fused q/k/v) in the order our RoPE kernels rotate
    with partial rotary (`rotary_head_order`); None where they are as stored."""
    order = rotary_head_order(config)
    if order is None or not hf_name.startswith("layers."):
        return None
    part = hf_name.split(".", 2)[2]
    hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads

    def heads(n: int, start: int = 0) -> np.ndarray:
        return (start + hd * np.arange(n)[:, None] + order[None, :]).reshape(-1)

    if part.startswith("self_attn.q_proj."):
        return heads(nh)
    if part.startswith("self_attn.k_proj."):
        return heads(nkv)
    if part.startswith("self_attn.qkv_proj."):
        return np.concatenate([heads(nh), heads(nkv, nh * hd), (nh + nkv) * hd
                               + np.arange(nkv * hd)])
    return None
