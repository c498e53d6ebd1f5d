"""LoRARequest: which adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest`."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """`lora_int_id` names the adapter inside the engine (a positive int, unique per adapter:
    the slots, the scheduler's adapter count and the prefix cache key on it); `lora_path` is a
    PEFT directory (adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
