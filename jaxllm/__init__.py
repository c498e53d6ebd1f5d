"""jaxllm: a JAX/Pallas reimplementation of vLLM's inference engine for Qwen2, Qwen3 and
Llama models."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxllm.beam_search import BeamSearchOutput, BeamSearchParams
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.entrypoints.llm import LLM
    from jaxllm.lora.request import LoRARequest
    from jaxllm.outputs import (
        CompletionOutput,
        EmbeddingOutput,
        EmbeddingRequestOutput,
        RequestOutput,
    )
    from jaxllm.pooling_params import PoolingParams
    from jaxllm.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

# The public names, imported on first use (as vLLM's package does): a process that needs only a
# leaf module (the grammar validator's worker) does not pay for the engine's imports.
_MODULE_ATTRS = {
    "AsyncLLM": "jaxllm.engine.async_llm",
    "BeamSearchOutput": "jaxllm.beam_search",
    "LoRARequest": "jaxllm.lora.request",
    "BeamSearchParams": "jaxllm.beam_search",
    "LLM": "jaxllm.entrypoints.llm",
    "CompletionOutput": "jaxllm.outputs",
    "EmbeddingOutput": "jaxllm.outputs",
    "EmbeddingRequestOutput": "jaxllm.outputs",
    "PoolingParams": "jaxllm.pooling_params",
    "RequestOutput": "jaxllm.outputs",
    "RequestOutputKind": "jaxllm.sampling_params",
    "SamplingParams": "jaxllm.sampling_params",
    "StructuredOutputsParams": "jaxllm.sampling_params",
}

__all__ = ["LLM", "AsyncLLM", "BeamSearchOutput", "BeamSearchParams", "CompletionOutput",
           "EmbeddingOutput", "EmbeddingRequestOutput", "LoRARequest", "PoolingParams",
           "RequestOutput",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _MODULE_ATTRS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
