"""The Qwen2 model shapes that the kernel checks, the performance models, the benchmarks and
the tests are sized by: the widths of each model's Hugging Face config.json. jaxllm builds a
``ModelConfig`` from ``Qwen2Shape.hf_config()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Qwen2Shape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool

    def layer_params(self) -> int:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + (q + 2 * kv) + q * self.hidden_size  # qkv bias
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp + 2 * self.hidden_size

    def params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tied_embeddings else embed
        return self.num_layers * self.layer_params() + embed + head + self.hidden_size

    def weight_bytes_per_step(self, itemsize: int = 2) -> int:
        """Every weight once, the (tied) LM head once, at ``itemsize`` bytes a parameter; the
        embedding lookup reads only a row per token, counted in the step, not here."""
        embed = self.vocab_size * self.hidden_size
        return (self.num_layers * self.layer_params() + embed + self.hidden_size) * itemsize

    def hf_config(self, **overrides: Any) -> dict[str, Any]:
        """The shape as Hugging Face config.json keys (``overrides`` replace or add keys)."""
        return {"model_type": "qwen2", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "tie_word_embeddings": self.tied_embeddings, **overrides}


QWEN2_SHAPES: dict[str, Qwen2Shape] = {s.name: s for s in (
    Qwen2Shape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, True),
    Qwen2Shape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, True),
    Qwen2Shape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, False),
    Qwen2Shape("qwen2-72b", 80, 8192, 64, 8, 128, 29568, 152064, False),
)}
