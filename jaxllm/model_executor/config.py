"""Model configuration: Qwen2 hyper-parameters from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = cfg.get("model_type")
        if arch not in ("qwen2", None):
            raise ValueError(f"model_type {arch!r} is not supported (jaxllm runs qwen2 models)")
        num_heads = cfg["num_attention_heads"]
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            # transformers 5 moved rope_theta into rope_parameters.
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or _quotient(cfg["hidden_size"], num_heads),
            rms_norm_eps=_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_float(rope_theta, "rope_theta"),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )

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
    def from_gguf_metadata(cls, meta: dict[str, Any], vocab_size: int, tied: bool) -> ModelConfig:
        """`meta` maps GGUF keys (e.g. 'qwen2.block_count') to values."""
        arch = meta.get("general.architecture")
        if arch != "qwen2":
            raise ValueError(f"GGUF architecture {arch!r} is not supported (jaxllm runs qwen2)")

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"qwen2.{key}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks qwen2.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(meta.get("qwen2.attention.key_length") or _quotient(hidden, num_heads)),
            rms_norm_eps=_float(get("attention.layer_norm_rms_epsilon", 1e-6), "rms_norm_eps"),
            rope_theta=_float(get("rope.freq_base", 10000.0), "rope_theta"),
            max_position_embeddings=int(get("context_length", 32768)),
            tie_word_embeddings=tied,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )


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
