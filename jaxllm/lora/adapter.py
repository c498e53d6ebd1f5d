"""A PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) read for one model:
each targeted projection's A [r, in] and B [out, r], with the scaling folded into B and B's
rows in the order the loader puts the model's own weight rows.

What the step cannot apply is refused by name rather than ignored: DoRA, biases, embedding or
LM-head targets, per-module rank or alpha patterns, modules to save whole, ranks above the
engine's `max_lora_rank`, and weights of the wrong shape for the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.model_loader.weight_layout import layer_weights, rotary_row_order

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_REFUSED_TARGETS = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


def lora_parts(config: ModelConfig) -> dict[str, tuple[str, str, int]]:
    """Each PEFT module name this model's adapters may target -> (its parent module, the
    model's fused projection it adds to, its part of that output). The names are the
    checkpoint's own (the loader's `layer_weights`), since PEFT wraps the modules the HF model
    has: q/k/v and gate/up apart in most families, fused (`qkv_proj`, `gate_up_proj`, one part
    spanning the whole output) where the checkpoint stores them fused (Phi-3)."""
    parts = {}
    for (parent, fused), names in layer_weights(config).items():
        for i, name in enumerate(names):
            parts[name.split(".")[1]] = (parent, fused, i)  # "self_attn.q_proj.weight"
    return parts


def module_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT module name this model's adapters may target."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = config.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * inter)}
    return {name: dims[name] for name in lora_parts(config)}


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


@dataclass
class LoRAAdapter:
    rank: int
    scale: float
    # (layer, PEFT module name) -> (A [r, in], B [out, r] times scale), float32.
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def read_adapter_config(path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The adapter's rank and scaling; ValueError for a missing directory or file, or a
    setting the engine does not run."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter directory {str(path)!r} does not exist")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    if not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE} (only safetensors "
                         f"adapters are read)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is unreadable: {e}") from e
    where = f"LoRA adapter {str(path)!r}"
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object, got "
                         f"{type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {cfg.get('bias')!r} is not supported (only 'none')")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication",
                "alora_invocation_tokens"):
        if cfg.get(key):
            raise ValueError(f"{where}: {key} is not supported")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.split("_")[0].lower() in ("pissa", "olora"):
        # These change the base weights too; only an adapter converted back to plain LoRA
        # applies to the unchanged model.
        raise ValueError(f"{where}: init_lora_weights {init!r} adapters need their base "
                         f"weights changed; convert the adapter to plain LoRA first")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    refused = [t for t in targets if any(name in t for name in _REFUSED_TARGETS)]
    if refused:
        raise ValueError(f"{where}: target modules {refused} are not supported (embeddings and "
                         f"the LM head)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)  # PEFT's LoraConfig default
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scale))


def load_adapter(path: str | Path, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter's weights for `config`'s model; ValueError names what does not fit."""
    from safetensors.numpy import load_file

    acfg = read_adapter_config(path, max_lora_rank)
    where = f"LoRA adapter {str(path)!r}"
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    except Exception as e:  # a corrupt file: safetensors raises its own error types
        raise ValueError(f"{where}: {WEIGHTS_FILE} is unreadable: {e}") from e
    dims, targets = module_dims(config), lora_parts(config)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA weight of a decoder "
                             f"layer's projection, named as PEFT saves it for a causal LM "
                             f"(base_model.model.model.layers.N.self_attn|mlp.MODULE."
                             f"lora_A|lora_B.weight; embedding, LM-head and bias weights are "
                             f"not supported)")
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if module not in targets or targets[module][0] != parent:
            raise ValueError(f"{where}: tensor {key!r} targets {parent}.{module}, which is not "
                             f"one of this {config.architecture}'s {sorted(targets)} (the "
                             f"checkpoint's own projection modules, fused or not)")
        if layer >= config.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the model has "
                             f"{config.num_hidden_layers}")
        parts.setdefault((layer, module), {})[which] = value
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{set(ab).pop()} "
                             f"without its pair")
        a, b = ab["A"].astype(np.float32), ab["B"].astype(np.float32)
        d_in, d_out = dims[module]
        if a.shape != (acfg.rank, d_in) or b.shape != (d_out, acfg.rank):
            raise ValueError(f"{where}: layer {layer} {module}: lora_A {a.shape} and lora_B "
                             f"{b.shape} do not fit rank {acfg.rank} and the model's "
                             f"({d_in} in, {d_out} out)")
        # B's rows are the projection's outputs: in the order the loader puts the base
        # weight's rows (partial rotary reorders each q and k head), or the delta would land
        # on other dims than HF's.
        rows = rotary_row_order(config, f"layers.{layer}.{targets[module][0]}.{module}.weight")
        if rows is not None:
            b = b[rows]
        weights[(layer, module)] = (a, b * np.float32(acfg.scale))
    if not weights:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(acfg.rank, acfg.scale, weights)


# The dense families: every decoder layer is Llama's projections (the delta's targets), under
# whatever norms, multipliers or soft caps the family adds around them.
LORA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                      "Gemma3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM",
                      "Phi3ForCausalLM")
_MOE = "a mixture of experts (the experts' projections take no adapter)"
_REFUSED_ARCHITECTURES = {"Qwen2MoeForCausalLM": _MOE, "Qwen3MoeForCausalLM": _MOE,
                          "MixtralForCausalLM": _MOE}


def check_lora_model(config: ModelConfig) -> None:
    """ValueError for a model family LoRA adapters do not run on."""
    if config.architecture not in LORA_ARCHITECTURES:
        # Every other family the registry runs is in LORA_ARCHITECTURES.
        reason = _REFUSED_ARCHITECTURES.get(config.architecture, "not a dense family")
        raise ValueError(f"enable_lora does not run {config.architecture}: {reason}; it runs "
                         f"{', '.join(LORA_ARCHITECTURES)}")
