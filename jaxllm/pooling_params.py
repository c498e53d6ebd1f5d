"""Per-request pooling parameters (embeddings), named, defaulted and validated as in vLLM."""

from __future__ import annotations

import copy
import numbers
from dataclasses import dataclass


def _optional_int(value: object, name: str, low: int, extra: str = "") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"PoolingParams.{name} must be an integer >= {low}{extra} or None, "
                         f"got {value!r}")
    return int(value)


def wrong_runner(runner: str) -> str:
    """Why a request of the other kind is refused by an engine started with `runner`: one
    engine either generates or embeds."""
    if runner == "pooling":
        return ("this engine has runner='pooling': it embeds prompts (LLM.embed, "
                "/v1/embeddings) and generates no text; start one with runner='generate' for "
                "that")
    return (f"embedding requests need an engine started with runner='pooling' "
            f"(LLM(model, runner='pooling'), `jaxllm serve --runner pooling`); this one has "
            f"runner={runner!r}")


@dataclass
class PoolingParams:
    """What an embedding request asks of the pooling runner (vLLM's PoolingParams).

    - `normalize`: L2-normalize the vector; None: as the engine's pooler_config says.
    - `dimensions`: keep only the first this many values (Matryoshka truncation), before the
      normalization; at most the model's hidden size (the engine refuses more). None: all.
    - `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: max_model_len).
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be True, False or None, got "
                             f"{self.normalize!r}")
        self.dimensions = _optional_int(self.dimensions, "dimensions", 1)
        if self.truncate_prompt_tokens != -1:
            self.truncate_prompt_tokens = _optional_int(
                self.truncate_prompt_tokens, "truncate_prompt_tokens", 1, " (or -1)")

    def clone(self) -> PoolingParams:
        return copy.copy(self)
