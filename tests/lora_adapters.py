"""PEFT LoRA adapter directories with random weights, for the LoRA tests of the engine and the
server: PEFT itself starts B at zero, which would test nothing."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
# Phi-3's checkpoints hold q/k/v and gate/up fused, so its adapters target those modules.
FUSED_ATTENTION_MODULES = ("qkv_proj", "o_proj")
FUSED_MLP_MODULES = ("gate_up_proj", "down_proj")


def _dims(cfg: Any) -> dict[str, tuple[int, int]]:
    # Gemma's head_dim is not hidden_size / num_attention_heads.
    h = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, \
        cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter)}


def write_adapter(path: Any, cfg: Any, *, rank: int, alpha: float, targets: tuple[str, ...],
                  seed: int, rslora: bool = False, **extra: Any) -> dict:
    """A PEFT directory at `path` with random A and B for the model of `cfg` (its HF config or
    any object with its fields); returns {(layer, parent, module): (A, B, scale)}."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    tensors, merged = {}, {}
    for i in range(cfg.num_hidden_layers):
        for m in targets:
            d_in, d_out = _dims(cfg)[m]
            a = rng.normal(0, 1 / math.sqrt(d_in), (rank, d_in)).astype(np.float32)
            b = rng.normal(0, 0.3 / math.sqrt(rank), (d_out, rank)).astype(np.float32)
            parent = "self_attn" if m in ATTENTION_MODULES + FUSED_ATTENTION_MODULES \
                else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{parent}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
            merged[(i, parent, m)] = (a, b, scale)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "use_rslora": rslora, "bias": "none",
              "use_dora": False, **extra}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return merged
