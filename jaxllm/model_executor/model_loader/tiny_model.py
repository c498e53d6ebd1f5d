"""The model named `tiny-qwen2` (`LLM(model="tiny-qwen2")`, `--model tiny-qwen2`): a random
2-layer Qwen2 (hidden 64) with the real 151,936-token vocabulary and the embedded model's
tokenizer. Its device step is nearly free, as a GPU step is next to our host work, so a benchmark
on it measures the host path (scheduling, input preparation, sampling over the full vocabulary,
detokenizing) on a CPU, and tests get a fast engine with real text. Written once as a Hugging
Face checkpoint (config.json, safetensors, tokenizer) under the cache directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

TINY_MODEL_NAME = "tiny-qwen2"
# Bump when the checkpoint below changes, so a stale cached copy is not reused.
_VERSION = 1
_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32",
}


def _weights(seed: int) -> dict[str, np.ndarray]:
    """Random weights in Hugging Face's Qwen2 names (q/k/v with biases, as Qwen2 has)."""
    rng = np.random.default_rng(seed)
    cfg = _CONFIG
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        return rng.normal(0.0, scale, shape).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden),
           "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": normal(hidden, hidden),
            p + "self_attn.q_proj.bias": normal(hidden, scale=0.5),
            p + "self_attn.k_proj.weight": normal(kv, hidden),
            p + "self_attn.k_proj.bias": normal(kv, scale=0.5),
            p + "self_attn.v_proj.weight": normal(kv, hidden),
            p + "self_attn.v_proj.bias": normal(kv, scale=0.5),
            p + "self_attn.o_proj.weight": normal(hidden, hidden),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    return out


def tiny_qwen2_path(seed: int = 0) -> Path:
    """The checkpoint directory, written on first use (~2 s plus the tokenizer)."""
    from safetensors.numpy import save_file

    from jaxllm.model_executor.model_loader.default_model import cache_dir, default_model_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    path = cache_dir() / "models" / f"{TINY_MODEL_NAME}-v{_VERSION}-seed{seed}"
    if (path / "config.json").is_file():
        return path
    # Written beside, then renamed: a concurrent or interrupted run never sees half of it.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(_weights(seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(default_model_path()).save_pretrained(str(tmp))
    (tmp / "config.json").write_text(json.dumps(_CONFIG, indent=2) + "\n")
    try:
        tmp.rename(path)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return path

