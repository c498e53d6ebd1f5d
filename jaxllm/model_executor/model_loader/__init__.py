"""Loading a Qwen2 checkpoint offline: HF directories, GGUF files, the embedded default model."""

from jaxllm.model_executor.model_loader.loader import LoadedModel, ModelLoadError, load_model

__all__ = ["LoadedModel", "ModelLoadError", "load_model"]
