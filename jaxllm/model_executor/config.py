"""Model configuration: a decoder's hyper-parameters from a Hugging Face config.json or GGUF
metadata, whatever its family; which families run is the model registry's business
(models/registry.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Hugging Face `model_type` -> the architecture a config.json without `architectures` names.
_ARCHITECTURE_OF_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                               "qwen2_moe": "Qwen2MoeForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                               "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                               "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                               "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}
# Architectures whose feed-forward is a mixture of experts (`MoEConfig`).
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# The Gemma families (`_gemma_fields`).
GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
# llama.cpp's names of MoE architectures, which its files store with per-expert tensors that
# the GGUF loader has no place for.
GGUF_MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe", "mixtral", "deepseek2", "olmoe")
# GGUF `general.architecture` -> Hugging Face architecture.
GGUF_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM",
                      "granite": "GraniteForCausalLM", "gemma": "GemmaForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "olmo2": "Olmo2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# transformers' config-class defaults of the fields a file of these families may leave out (the
# generic defaults below are Qwen2's).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
                        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 32000},
    "GraniteForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                           "bos_token_id": 1, "eos_token_id": 2},
    "Olmo2ForCausalLM": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
                         "eos_token_id": 50279},
}


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training length (Hugging Face's
    `rope_parameters` / `rope_scaling`); the frequencies are rotary_embedding.py's."""

    rope_type: str  # one of ROPE_TYPES other than "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # longrope (Phi-3.5, Phi-4-mini): each frequency divided by its factor, the short ones for
    # positions below original_max_position_embeddings, the long ones from there on
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_position_embeddings: Any,
                original_max: Any = None) -> RopeScaling | None:
        """None for plain RoPE; a ValueError names an unsupported type or a bad value."""
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"model config: rope type {rope_type!r} is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
        if rope_type == "default":
            return None
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
        values = {k: v for k, v in params.items() if k in known and v is not None}
        if rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = values.get(name)
                if not isinstance(factors, list) or not factors or not all(
                        isinstance(f, (int, float)) and not isinstance(f, bool)
                        and math.isfinite(f) and f > 0 for f in factors):
                    raise ValueError(f"model config: rope {name} must be a list of finite "
                                     f"numbers > 0, got {factors!r}")
                values[name] = tuple(float(f) for f in factors)
        elif values.get("short_factor") is not None or values.get("long_factor") is not None:
            raise ValueError(f"model config: rope short_factor / long_factor belong to rope "
                             f"type 'longrope', not {rope_type!r}")
        if rope_type in ("llama3", "yarn", "longrope"):
            # As Hugging Face reads it: a top-level value first, then the parameters' own, then
            # the model's length.
            values["original_max_position_embeddings"] = (
                original_max or values.get("original_max_position_embeddings")
                or max_position_embeddings)
        if rope_type == "yarn":
            values["beta_fast"] = values.get("beta_fast") or 32.0
            values["beta_slow"] = values.get("beta_slow") or 1.0
            if "factor" not in values and values.get("original_max_position_embeddings"):
                values["factor"] = max_position_embeddings / \
                    values["original_max_position_embeddings"]
        if rope_type == "longrope" and "factor" not in values:
            # Its attention factor's default reads the stretch of the two lengths.
            original = values["original_max_position_embeddings"]
            if isinstance(original, (int, float)) and original > 0 \
                    and isinstance(max_position_embeddings, (int, float)):
                values["factor"] = max_position_embeddings / original
        if "factor" not in values:
            raise ValueError(f"model config: rope type {rope_type!r} needs a factor")
        for name, value in values.items():
            if name in ("short_factor", "long_factor"):
                continue
            if name == "truncate":
                if not isinstance(value, bool):
                    raise ValueError(f"model config: rope {name} must be true or false, "
                                     f"got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"model config: rope {name} must be a finite number > 0, "
                                 f"got {value!r}")
        if "original_max_position_embeddings" in values:
            values["original_max_position_embeddings"] = int(
                values["original_max_position_embeddings"])
        return cls(rope_type, **values)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (layers/fused_moe.py): a router picks `top_k` of
    `num_experts` SwiGLU experts per token, their outputs are summed weighted by the router's
    probabilities; Qwen2-MoE adds a shared expert whose output a sigmoid gate scales."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # each expert's (moe_intermediate_size; Mixtral's intermediate_size)
    # The top-k probabilities divided by their sum (Mixtral always; Qwen's `norm_topk_prob`).
    renormalize: bool
    # Layers whose MLP is this block; the others keep the dense MLP of `intermediate_size`
    # (Qwen's `mlp_only_layers` and `decoder_sparse_step`).
    sparse_layers: tuple[int, ...]
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
                raise ValueError(f"model config: {_MOE_FIELD_NAMES.get(name, name)} must be a "
                                 f"positive integer below 2**31, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model config: num_experts_per_tok ({self.top_k}) exceeds the "
                             f"number of experts ({self.num_experts})")
        shared = self.shared_expert_intermediate_size
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared < 2**31:
            raise ValueError(f"model config: shared_expert_intermediate_size must be an integer "
                             f">= 0, got {shared!r}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
        """The MoE block of a Qwen2-MoE, Qwen3-MoE or Mixtral config.json; None where no layer
        has one (num_experts 0)."""
        # A field the file leaves out has its transformers config class's default.
        defaults = _MOE_DEFAULTS[architecture]
        # transformers 5 writes Qwen3-MoE's as `num_local_experts`, Qwen2-MoE's as `num_experts`.
        num_experts: Any = cfg.get("num_experts", cfg.get("num_local_experts",
                                                          defaults["num_experts"]))
        cfg = {**defaults, **cfg}
        if num_experts == 0:
            return None
        layers = cfg["num_hidden_layers"]
        inter: Any  # checked by __post_init__
        if architecture == "MixtralForCausalLM":
            sparse = tuple(range(layers)) if isinstance(layers, int) else ()
            inter, renormalize, shared = cfg.get("intermediate_size"), True, 0
        else:
            step = cfg.get("decoder_sparse_step", 1)
            dense = cfg.get("mlp_only_layers") or []
            if isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"model config: decoder_sparse_step must be a positive "
                                 f"integer, got {step!r}")
            if not isinstance(dense, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in dense):
                raise ValueError(f"model config: mlp_only_layers must be a list of layer "
                                 f"indices, got {dense!r}")
            # As transformers builds each decoder layer.
            sparse = tuple(i for i in range(layers if isinstance(layers, int) else 0)
                           if i not in dense and (i + 1) % step == 0)
            inter = cfg.get("moe_intermediate_size")
            renormalize = bool(cfg.get("norm_topk_prob", False))
            shared = (cfg.get("shared_expert_intermediate_size", 0)
                      if architecture == "Qwen2MoeForCausalLM" else 0)
        return cls(num_experts=num_experts, top_k=cfg.get("num_experts_per_tok", 2),
                   intermediate_size=inter, renormalize=renormalize, sparse_layers=sparse,
                   shared_expert_intermediate_size=shared or 0)


# transformers' defaults of the MoE configs (Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig).
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen2MoeForCausalLM": {"num_experts": 60, "num_experts_per_tok": 4,
                            "moe_intermediate_size": 1408,
                            "shared_expert_intermediate_size": 5632},
    "Qwen3MoeForCausalLM": {"num_experts": 128, "num_experts_per_tok": 8,
                            "moe_intermediate_size": 768},
    "MixtralForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2},
}

_MOE_FIELD_NAMES = {"num_experts": "num_experts (num_local_experts)", "top_k":
                    "num_experts_per_tok", "intermediate_size": "moe_intermediate_size"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Every token that ends a generation: Llama 3 Instruct ends a turn with <|eot_id|>, listed
    # beside <|end_of_text|> in config.json or generation_config.json. Empty: `eos_token_id`.
    eos_token_ids: tuple[int, ...] = ()
    # The Hugging Face architecture (`architectures[0]`), which picks the model class.
    architecture: str = "Qwen2ForCausalLM"
    attention_bias: bool = True  # q, k and v projections with biases (Qwen2's always have)
    o_proj_bias: bool = False  # the attention's output projection with a bias (Llama, Qwen3)
    rope_scaling: RopeScaling | None = None
    # A GGUF's `rope_freqs` tensor (llama.cpp's form of Llama 3's scaling): each frequency is
    # divided by its factor.
    rope_freq_factors: tuple[float, ...] | None = None
    # Keys a query sees, its own position included (Hugging Face's window: a query at p sees
    # keys k with p - sliding_window < k <= p); None: the whole context, on every layer.
    sliding_window: int | None = None
    # Mixture-of-experts feed-forward of the MoE families; None: every layer's MLP is dense.
    moe: MoEConfig | None = None
    # Layers that attend to the whole context although the model has a window (Qwen2's
    # first max_window_layers, or its `layer_types`); every other layer slides.
    full_attention_layers: tuple[int, ...] = ()
    # RoPE on the first int(head_dim * factor) dims of each q and k head only (Phi-4-mini).
    partial_rotary_factor: float = 1.0
    # Granite's: the embeddings times embedding_multiplier, each attention and MLP output times
    # residual_multiplier before it joins the residual, attention scores times
    # attention_multiplier (None: head_dim ** -0.5), logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # The MLP's activation on its gate: "silu" (SwiGLU), or Gemma's "gelu_pytorch_tanh" (GELU's
    # tanh approximation).
    hidden_act: str = "silu"
    # Gemma 2/3: q.k scaled by query_pre_attn_scalar ** -0.5; None: by head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 2: the attention's scaled logits, and the LM head's logits, become
    # cap * tanh(x / cap); None: not capped.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the RoPE base (and scaling) of the sliding-window layers, apart from the other
    # layers' `rope_theta` / `rope_scaling`; None: every layer has the same RoPE.
    rope_local_theta: float | None = None
    rope_local_scaling: RopeScaling | None = None

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates, the first ones (Hugging Face's order)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """The scale of q.k: Granite's attention_multiplier, Gemma's
        query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar ** -0.5
        return self.head_dim ** -0.5

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window of layer `layer`'s attention; None: the whole context."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def max_attended_keys(self, max_model_len: int) -> int:
        """The most keys any layer's query sees in a context of max_model_len tokens: the
        window when every layer slides (what sizes split-K decode)."""
        return max(min(self.layer_sliding_window(i) or max_model_len, max_model_len)
                   for i in range(self.num_hidden_layers))

    @property
    def max_context_len(self) -> int:
        """Positions the model takes: max_position_embeddings, stretched by a linear or YaRN
        scaling (whose configs leave it at the trained length, as vLLM reads them; Llama 3's
        already name the stretched one)."""
        s = self.rope_scaling
        # Gemma 3's max_position_embeddings is already the stretched length (as vLLM reads it).
        if s is None or s.rope_type not in ("linear", "yarn") \
                or self.architecture == "Gemma3ForCausalLM":
            return self.max_position_embeddings
        trained = s.original_max_position_embeddings if s.rope_type == "yarn" else None
        return max(self.max_position_embeddings,
                   int((trained or self.max_position_embeddings) * s.factor))

    def __post_init__(self) -> None:
        # Checkpoints are input: a count of the wrong type or size is named here rather than
        # failing inside the model's shapes; int32 bounds what positions and ids are computed in.
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
                raise ValueError(f"model config: {name} must be a positive integer below 2**31, "
                                 f"got {value!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not (math.isfinite(_float(value, name)) and value > 0)):
                raise ValueError(f"model config: {name} must be a finite number > 0, "
                                 f"got {value!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                   for t in self.eos_token_ids):
            raise ValueError(f"model config: eos_token_id must be token ids, got "
                             f"{list(self.eos_token_ids)!r}")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or not 0 < window < 2**31):
            raise ValueError(f"model config: sliding_window must be a positive integer below "
                             f"2**31 or null, got {window!r}")
        if not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers
                   for i in self.full_attention_layers):
            raise ValueError(f"model config: full_attention_layers must be layer indices, got "
                             f"{self.full_attention_layers!r}")
        for name in ("partial_rotary_factor", "embedding_multiplier", "residual_multiplier",
                     "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is None and name == "attention_multiplier":
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value == 0):
                raise ValueError(f"model config: {name} must be a finite nonzero number, got "
                                 f"{value!r}")
        rotary = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotary < 2 or rotary % 2:
            raise ValueError(f"model config: partial_rotary_factor {self.partial_rotary_factor!r} "
                             f"makes {rotary} rotary dims of head_dim {self.head_dim}; RoPE "
                             f"needs an even number of them, at least 2")
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(s, name)
                if factors is None or len(factors) != rotary // 2:
                    raise ValueError(f"model config: rope {name} must list rotary dims / 2 = "
                                     f"{rotary // 2} factors, got "
                                     f"{None if factors is None else len(factors)}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported "
                             f"(silu, gelu_pytorch_tanh)")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))
                                      or not (math.isfinite(value) and value > 0)):
                raise ValueError(f"model config: {name} must be a finite number > 0 or null, "
                                 f"got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        architectures = cfg.get("architectures")
        if architectures is not None and not isinstance(architectures, list):
            raise ValueError(f"model config: architectures must be a list of names, got "
                             f"{architectures!r}")
        if architectures:
            architecture = architectures[0]
        else:
            model_type = cfg.get("model_type", "qwen2")
            architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
            if architecture is None:
                raise ValueError(f"model_type {model_type!r} is not supported and the config "
                                 f"names no architectures (supported model types: "
                                 f"{', '.join(_ARCHITECTURE_OF_MODEL_TYPE)})")
        if not isinstance(architecture, str):
            raise ValueError(f"model config: architectures must be a list of names, got "
                             f"{architectures!r}")
        cfg = {**_FAMILY_DEFAULTS.get(architecture, {}), **cfg}
        phi3 = architecture == "Phi3ForCausalLM"
        num_heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if not isinstance(rope_params, dict):
            raise ValueError(f"model config: rope parameters must be an object, got "
                             f"{rope_params!r}")
        if phi3:
            # Phi3Config's reading: older files name longrope "su" or "yarn"; it takes no other.
            rope_type = rope_params.get("rope_type") or rope_params.get("type") or "default"
            if rope_type in ("su", "yarn"):
                rope_params = {**rope_params, "rope_type": "longrope"}
            elif rope_type not in ("default", "longrope"):
                raise ValueError(f"model config: rope type {rope_type!r} is not Phi-3's "
                                 f"(default or longrope)")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            # transformers 5 moved rope_theta into rope_parameters.
            rope_theta = rope_params.get("rope_theta", 10000.0)
        max_pos = cfg.get("max_position_embeddings", 32768)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor"))
        if partial is None:
            partial = 1.0
        elif partial not in (1, 1.0) and not phi3:
            raise ValueError(f"model config: partial_rotary_factor {partial!r} (RoPE on part of "
                             f"each head) is not supported for {architecture}")
        if cfg.get("mlp_bias"):
            raise ValueError("model config: mlp_bias (biases on the MLP projections) is not "
                             "supported")
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act != "silu" and architecture not in GEMMA_ARCHITECTURES:  # Gemma's: _gemma_fields
            raise ValueError(f"model config: hidden_act {act!r} is not supported (the MLPs "
                             f"here are SwiGLU: silu)")
        # Qwen2's q/k/v always carry biases and its o_proj none (Qwen2-MoE's as its `qkv_bias`
        # says); Llama's and Qwen3's `attention_bias` puts one on all four; Mistral's and
        # Mixtral's projections have none.
        qwen2_bias = {"Qwen2ForCausalLM": True,
                      "Qwen2MoeForCausalLM": bool(cfg.get("qkv_bias", True))}
        mistral = architecture in ("MistralForCausalLM", "MixtralForCausalLM")
        if architecture in qwen2_bias:
            bias, o_bias = qwen2_bias[architecture], False
        else:  # Phi-3's projections have none either
            bias = not (mistral or phi3) and bool(cfg.get("attention_bias", False))
            o_bias = bias
        window, full_layers = _hf_sliding_window(cfg, architecture)
        moe = MoEConfig.from_hf(cfg, architecture) if architecture in MOE_ARCHITECTURES else None
        config = cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or _quotient(cfg["hidden_size"], num_heads),
            rms_norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_float(rope_theta, "rope_theta"),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            eos_token_ids=eos_ids,
            architecture=architecture,
            attention_bias=bias,
            o_proj_bias=o_bias,
            rope_scaling=RopeScaling.from_hf(rope_params, max_pos,
                                             cfg.get("original_max_position_embeddings")),
            sliding_window=window,
            moe=moe,
            full_attention_layers=full_layers,
            partial_rotary_factor=partial,
            **_granite_multipliers(cfg, architecture),
        )
        if architecture in GEMMA_ARCHITECTURES:
            config = dataclasses.replace(config, **_gemma_fields(cfg, architecture))
        return config

    def with_generation_config(self, path: str | Path) -> ModelConfig:
        """This config with the end-of-generation tokens a generation_config.json beside it
        adds (unreadable or absent: unchanged, the model runs without it; ids that are not
        token ids: a ValueError naming the file)."""
        try:
            gen = json.loads(Path(path).read_text())
        except (OSError, ValueError, RecursionError):
            return self
        eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
        extra = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in extra):
            raise ValueError(f"{path}: eos_token_id must be token ids, got {eos!r}")
        ids = list(self.eos_token_ids or ([] if self.eos_token_id is None
                                          else [self.eos_token_id]))
        ids += [t for t in extra if t not in ids]
        return dataclasses.replace(self, eos_token_ids=tuple(ids))

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:  # unreadable, not UTF-8 or not JSON
            raise ValueError(f"{path}: cannot read model config: {type(e).__name__}: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: the model config must be a JSON object, got "
                             f"{type(cfg).__name__}")
        try:
            return cls.from_hf_config(cfg)
        except KeyError as e:
            raise ValueError(f"{path}: model config lacks {e.args[0]!r}") from e

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], vocab_size: int, tied: bool,
                           attention_bias: bool = True, o_proj_bias: bool = False,
                           rope_freq_factors: tuple[float, ...] | None = None,
                           longrope_factors: tuple[list[float], list[float]] | None = None
                           ) -> ModelConfig:
        """`meta` maps GGUF keys (e.g. 'qwen2.block_count') to values; `attention_bias`,
        `o_proj_bias`: whether the file has q/k/v biases, an attention output bias;
        `longrope_factors`: Phi-3's (short, long) factors, its `rope_factors_short` and
        `rope_factors_long` tensors."""
        arch = meta.get("general.architecture")
        if arch in GGUF_MOE_ARCHITECTURES or (
                arch in GGUF_ARCHITECTURES and meta.get(f"{arch}.expert_count")):
            raise ValueError(f"GGUF architecture {arch!r} with experts (a mixture-of-experts "
                             f"model: ffn_gate_inp / ffn_*_exps tensors) is not supported from "
                             f"GGUF; the Hugging Face checkpoints (safetensors) of Qwen2-MoE, "
                             f"Qwen3-MoE and Mixtral load")
        if arch == "olmo2" and _window(meta.get(f"{arch}.attention.sliding_window")):
            # llama.cpp's converter writes OLMo 3 as olmo2 with a window on three layers in
            # four; transformers' OLMo 2 has none.
            raise ValueError("GGUF architecture 'olmo2' with a sliding window (an OLMo 3 "
                             "file) is not supported; OLMo 2 files (no window) load")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)})")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        max_pos = int(get("context_length", 32768))
        head_dim = int(meta.get(f"{arch}.attention.key_length") or _quotient(hidden, num_heads))
        partial = 1.0
        rope_dim = meta.get(f"{arch}.rope.dimension_count")
        if arch == "phi3" and rope_dim is not None and int(rope_dim) != head_dim:
            partial = int(rope_dim) / head_dim
            if int(head_dim * partial) != int(rope_dim):
                raise ValueError(f"GGUF {arch}.rope.dimension_count {rope_dim} of head_dim "
                                 f"{head_dim} is not a rotary dim this model takes")
        scaling = None
        scaling_type = meta.get(f"{arch}.rope.scaling.type")
        if longrope_factors is not None:
            # llama.cpp's form of Phi-3's longrope: the factors as tensors, the attention
            # factor and the original length as metadata.
            short, long = longrope_factors
            scaling = RopeScaling.from_hf(
                {"rope_type": "longrope", "short_factor": short, "long_factor": long,
                 "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")},
                max_pos, meta.get(f"{arch}.rope.scaling.original_context_length"))
        elif scaling_type not in (None, "none"):
            original = meta.get(f"{arch}.rope.scaling.original_context_length")
            scaling = RopeScaling.from_hf(
                {"rope_type": scaling_type, "factor": meta.get(f"{arch}.rope.scaling.factor")},
                max_pos, original)
        config = cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=_float(get("attention.layer_norm_rms_epsilon", 1e-6), "rms_norm_eps"),
            rope_theta=_float(get("rope.freq_base", 10000.0), "rope_theta"),
            max_position_embeddings=max_pos,
            tie_word_embeddings=tied,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            # llama.cpp's end-of-turn and end-of-message tokens (Llama 3's <|eot_id|>,
            # <|eom_id|>) end a generation too.
            eos_token_ids=tuple(dict.fromkeys(
                t for t in (meta.get("tokenizer.ggml.eos_token_id"),
                            meta.get("tokenizer.ggml.eot_token_id"),
                            meta.get("tokenizer.ggml.eom_token_id")) if t is not None)),
            architecture=GGUF_ARCHITECTURES[arch],
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            # llama.cpp names one window for every layer.
            sliding_window=_window(meta.get(f"{arch}.attention.sliding_window")),
            partial_rotary_factor=partial,
            **_gguf_granite_multipliers(meta, arch),
        )
        if config.architecture in GEMMA_ARCHITECTURES:
            config = dataclasses.replace(config, **_gguf_gemma_fields(meta, arch, config))
        return config


def _gguf_granite_multipliers(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """Granite's multipliers as llama.cpp stores them (1.0 where the file names none); none
    for other architectures."""
    if arch != "granite":
        return {}
    keys = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
            "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
    return {name: _float(meta.get(f"{arch}.{key}", 1.0), key) for name, key in keys.items()}


# llama.cpp's layer counts of Gemma 2 27B and Gemma 3 27B, whose q.k scale is
# (hidden / heads) ** -0.5 rather than head_dim's, as their query_pre_attn_scalar says.
_GGUF_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_gemma_fields(meta: dict[str, Any], arch: str, config: ModelConfig) -> dict[str, Any]:
    """What a Gemma GGUF's metadata sets beyond Llama's fields, as llama.cpp reads it (its
    defaults where the file is silent). llama.cpp's converter writes no activation (GELU's
    tanh approximation), no query_pre_attn_scalar, no sliding-window pattern and, for Gemma 3,
    no local RoPE base; they are derived as llama.cpp derives them."""
    fields: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh"}
    if arch == "gemma":  # llama.cpp's Gemma reads no window
        return {**fields, "sliding_window": None}
    layers = config.num_hidden_layers
    scalar = config.head_dim
    if _GGUF_GEMMA_27B_LAYERS[arch] == layers:
        scalar = config.hidden_size // config.num_attention_heads
    fields["query_pre_attn_scalar"] = scalar
    caps = {name: meta.get(f"{arch}.{name}") for name in ("attn_logit_softcapping",
                                                          "final_logit_softcapping")}
    if arch == "gemma2":  # Gemma 2 always caps, at llama.cpp's defaults where the file is silent
        defaults = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
        caps = {name: defaults[name] if cap is None else cap for name, cap in caps.items()}
    else:  # Gemma 3's attention has no cap, and its final cap 0 is none
        caps = {"attn_logit_softcapping": None,
                "final_logit_softcapping": caps["final_logit_softcapping"] or None}
    fields.update({name: None if cap is None else _float(cap, name)
                   for name, cap in caps.items()})
    # Gemma 2's window defaults to 4096; a Gemma 3 file without one (or 0) slides nowhere.
    window = _window(meta.get(f"{arch}.attention.sliding_window",
                              4096 if arch == "gemma2" else None))
    sliding = _gguf_sliding_layers(meta.get(f"{arch}.attention.sliding_window_pattern",
                                            2 if arch == "gemma2" else 6), layers, arch)
    if window is None or not any(sliding):
        return {**fields, "sliding_window": None, "full_attention_layers": ()}
    fields.update(sliding_window=window,
                  full_attention_layers=tuple(i for i, s in enumerate(sliding) if not s))
    # The sliding layers' RoPE: `rope.freq_base_swa` where the file names it, else Gemma 3's
    # 10,000 unscaled (the global layers' scaling is theirs alone) and Gemma 2's global RoPE.
    local = meta.get(f"{arch}.rope.freq_base_swa", 10_000.0 if arch == "gemma3" else None)
    if local is not None:
        fields.update(rope_local_theta=_float(local, "rope.freq_base_swa"),
                      rope_local_scaling=config.rope_scaling if arch == "gemma2" else None)
    return fields


def _gguf_sliding_layers(pattern: Any, num_layers: int, arch: str) -> list[bool]:
    """Whether each layer slides, from a GGUF's `attention.sliding_window_pattern`: a list of
    one flag per layer, or llama.cpp's period n (every n-th layer global, the others sliding;
    0: every layer slides)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, (bool, int)) for p in pattern):
            raise ValueError(f"GGUF {key} must flag each of the {num_layers} layers, got "
                             f"{pattern!r}")
        return [bool(p) for p in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ValueError(f"GGUF {key} must be a period (an integer >= 0) or per-layer flags, "
                         f"got {pattern!r}")
    return [pattern == 0 or i % pattern < pattern - 1 for i in range(num_layers)]


def _granite_multipliers(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Granite's multipliers as GraniteConfig reads them (1.0 where the file names none:
    attention scores then scaled by 1, not head_dim ** -0.5); none for other families."""
    if architecture != "GraniteForCausalLM":
        return {}
    names = ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
             "logits_scaling")
    return {name: cfg.get(name, 1.0) for name in names}


def _hf_sliding_window(cfg: dict[str, Any], architecture: str
                       ) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, full_attention_layers) as transformers builds the attention of each
    layer: Mistral and Phi-3 slide on every layer (Mistral's config class fills in a 4096-token
    window when the file names none; both ignore `layer_types`); Qwen2/Qwen3 configs carry a
    window they use only with `use_sliding_window`, and then on the layers `layer_types` names
    "sliding_attention", by default those from `max_window_layers` on. A model none of whose
    layers slides has no window."""
    if architecture == "Olmo2ForCausalLM":  # its attention has no window
        return None, ()
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        # Phi-3's too: every layer, with the window its file names (none by default).
        default = 4096 if architecture == "MistralForCausalLM" else None
        return cfg.get("sliding_window", default), ()
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    if window is None:
        return None, ()
    if architecture == "Qwen3MoeForCausalLM":  # every layer, as Mistral's
        return window, ()
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first = cfg.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"model config: max_window_layers must be an integer, got "
                             f"{first!r}")
        n = num_layers if isinstance(num_layers, int) else 0
        if architecture == "Qwen2MoeForCausalLM":  # its config's own rule: even layers below
            layer_types = ["sliding_attention" if i % 2 == 0 and i < first
                           else "full_attention" for i in range(n)]
        else:
            layer_types = ["sliding_attention" if i >= first else "full_attention"
                           for i in range(n)]
    _check_layer_types(layer_types, num_layers)
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if len(full) == len(layer_types):
        return None, ()
    return window, full


def _check_layer_types(layer_types: Any, num_layers: Any) -> None:
    """A ValueError unless `layer_types` names each of the model's layers "sliding_attention"
    or "full_attention"."""
    if not isinstance(layer_types, list) or not set(layer_types) <= {"sliding_attention",
                                                                      "full_attention"}:
        raise ValueError(f"model config: layer_types must list \"sliding_attention\" or "
                         f"\"full_attention\" per layer, got {layer_types!r}")
    if len(layer_types) != num_layers:
        raise ValueError(f"model config: layer_types names {len(layer_types)} layers, "
                         f"num_hidden_layers is {num_layers}")


def _gemma_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """What a Gemma config.json sets beyond Llama's fields, as transformers' Gemma, Gemma2 and
    Gemma3Text configs read it (their defaults where the file is silent): the GELU activation,
    tied embeddings, the context length, and for Gemma 2/3 the attention scale, soft caps,
    sliding-window layers and (Gemma 3) the sliding layers' own RoPE. Options no model here
    runs are refused by name."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("model config: use_bidirectional_attention (a Gemma encoder: every "
                         "token sees the whole sequence) is not supported")
    gemma1 = architecture == "GemmaForCausalLM"
    # Gemma's config reads `hidden_act`, whose legacy "gelu" means the tanh approximation;
    # Gemma 2's and 3's read `hidden_activation` only.
    act = (cfg.get("hidden_act") if gemma1 else cfg.get("hidden_activation")) \
        or "gelu_pytorch_tanh"
    if gemma1 and act == "gelu":
        act = "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        name = "hidden_act" if gemma1 else "hidden_activation"
        raise ValueError(f"model config: {name} {act!r} is not supported for {architecture} "
                         f"(gelu_pytorch_tanh)")
    gemma3 = architecture == "Gemma3ForCausalLM"
    max_pos = cfg.get("max_position_embeddings", 131072 if gemma3 else 8192)
    fields: dict[str, Any] = {"hidden_act": act, "max_position_embeddings": max_pos,
                              "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}
    if gemma1:
        return fields
    attn_cap = cfg.get("attn_logit_softcapping", None if gemma3 else 50.0)
    if gemma3 and attn_cap is not None:
        # Gemma 3's attention in transformers never applies it.
        raise ValueError(f"model config: attn_logit_softcapping {attn_cap!r} is not supported "
                         f"for Gemma3ForCausalLM (its attention has no soft cap)")
    fields.update(query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
                  attn_logit_softcapping=attn_cap,
                  final_logit_softcapping=cfg.get("final_logit_softcapping",
                                                  None if gemma3 else 30.0))
    num_layers = cfg["num_hidden_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        # Every `pattern`-th layer attends to the whole context (Gemma 2: every second).
        pattern = cfg.get("sliding_window_pattern", 6) if gemma3 else 2
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"model config: sliding_window_pattern must be a positive integer, "
                             f"got {pattern!r}")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers if isinstance(num_layers, int) else 0)]
    _check_layer_types(layer_types, num_layers)
    window = cfg.get("sliding_window", 4096)
    full = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if gemma3 and window is None and len(full) < len(layer_types):
        # transformers then attends to the whole context on its sliding layers but keeps their
        # own RoPE, which this config cannot express (the local RoPE follows the window).
        raise ValueError("model config: sliding_window null with sliding_attention layers is "
                         "not supported for Gemma3ForCausalLM")
    if window is None or len(full) == len(layer_types):
        window, full = None, ()
    fields.update(sliding_window=window, full_attention_layers=full)
    if gemma3:
        fields.update(_gemma3_rope(cfg, max_pos))
    return fields


def _gemma3_rope(cfg: dict[str, Any], max_pos: Any) -> dict[str, Any]:
    """Gemma 3's two RoPEs as transformers 5 builds them: `rope_parameters` keyed by layer type
    ("full_attention", "sliding_attention"), or in older files `rope_theta` (default 1e6) and
    `rope_scaling` for the full layers and `rope_local_base_freq` (default 1e4) for the
    sliding ones."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ({"full_attention", "sliding_attention"} & set(params)):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
    else:
        full = {**(cfg.get("rope_scaling") or {}), **(params or {})}
        local = {}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise ValueError(f"model config: rope parameters must be objects, got {params!r}")
    theta = full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return {"rope_theta": _float(theta, "rope_theta"),
            "rope_scaling": RopeScaling.from_hf(full, max_pos),
            "rope_local_theta": _float(local_theta, "rope_local_base_freq"),
            "rope_local_scaling": RopeScaling.from_hf(local, max_pos)}


def _window(value: Any) -> Any:
    """A GGUF window as an int (the reader may hand back numpy integers), 0 as None (how
    llama.cpp's converter writes a config's null window, Phi-4's); anything else as is, for
    __post_init__ to name."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return value
    return operator.index(value) or None


def _quotient(hidden: Any, num_heads: Any) -> Any:
    """hidden // num_heads where both are usable; else `hidden`, leaving __post_init__ to name
    the bad field."""
    if isinstance(hidden, int) and isinstance(num_heads, int) and num_heads > 0:
        return hidden // num_heads
    return hidden


def _float(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"model config: {name} must be a number, got {value!r}") from None
