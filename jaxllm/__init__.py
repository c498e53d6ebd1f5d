"""jaxllm: a JAX/Pallas reimplementation of vLLM's inference engine for Qwen2-family models."""

from jaxllm.entrypoints.llm import LLM
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
