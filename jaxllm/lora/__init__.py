"""LoRA adapters (vLLM's `enable_lora`): the request (`request.py`), a PEFT directory read
into per-layer matrices (`adapter.py`), the device slots the step reads (`slots.py`) and the
delta added to the model's projections inside the step (`layers.py`)."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
