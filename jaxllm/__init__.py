"""jaxllm: a JAX/Pallas reimplementation of vLLM's inference engine for Qwen2-family models."""

from jaxllm.engine.async_llm import AsyncLLM
from jaxllm.entrypoints.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "CompletionOutput", "RequestOutput", "RequestOutputKind",
           "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"
