"""LoRARequest: which adapter a request runs with, as vLLM's `vllm.lora.request.LoRARequest`."""

from __future__ import annotations

import os

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


def check_same_adapter(known: LoRARequest | None, lora: LoRARequest) -> bool:
    """Whether `lora`'s id is already known (`known`, the request first seen with it); a
    ValueError when that id names another adapter's directory. Paths are compared resolved
    (a trailing slash, a relative path, a symlink name the same directory) but kept as
    given."""
    if known is None:
        return False
    if known.lora_path != lora.lora_path \
            and os.path.realpath(known.lora_path) != os.path.realpath(lora.lora_path):
        raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter "
                         f"{known.lora_name!r} at {known.lora_path!r}, not "
                         f"{lora.lora_path!r}: each adapter needs its own id")
    return True
