"""The adapters the step can read: per decoder layer and fused projection, A [S, in, width]
and B [S, width, out] over S = max_loras slots; a token's slot is 1..S, or 0 for a request
without an adapter, which reads none of them (the step reads every slot's weights, so a zero
slot would cost as much as a real one). A fused projection's parts (q, k, v; gate, up) each
own `max_lora_rank` columns of A and rows of B, so B is block-diagonal over the parts and one
contraction serves them all; ranks below the maximum are zero-padded, the scaling is in B.

Slots are filled on the host, least recently activated first, never one a live request reads
(the scheduler keeps the adapters of running requests within max_loras), and the whole tree
is put on the device again after a change: a change happens when a request with an adapter
not in a slot starts, not per step.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxllm.lora.adapter import FUSED_PARTS, LoRAAdapter, load_adapter, module_dims
from jaxllm.lora.request import LoRARequest, check_same_adapter
from jaxllm.model_executor.config import ModelConfig

# Fused projection -> its PEFT parts in output order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {}
for _name, (_fused, _part) in FUSED_PARTS.items():
    FUSED_MODULES.setdefault(_fused, ())
    FUSED_MODULES[_fused] += (_name,)


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: Any) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and "
                             f"{max_lora_rank}")
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        dims = module_dims(config)
        r = max_lora_rank
        s = max_loras
        # fused name -> (in, [(PEFT part, first output column, width)], out)
        self.layout: dict[str, tuple[int, list[tuple[str, int, int]], int]] = {}
        for fused, names in FUSED_MODULES.items():
            offsets, col = [], 0
            for name in names:
                offsets.append((name, col, dims[name][1]))
                col += dims[name][1]
            self.layout[fused] = (dims[names[0]][0], offsets, col)
        self.host = {f"layers_{i}": {
            fused: {"A": np.zeros((s, d_in, len(parts) * r), np.float32),
                    "B": np.zeros((s, len(parts) * r, d_out), np.float32)}
            for fused, (d_in, parts, d_out) in self.layout.items()}
            for i in range(config.num_hidden_layers)}
        self.requests: dict[int, LoRARequest] = {}
        # Every registered adapter, parsed once: a slot load inside a step never reads the
        # disk, where a file deleted or rewritten since would fail the step (or change the
        # weights behind blocks the prefix cache keys on the adapter's id).
        self.adapters: dict[int, LoRAAdapter] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> slot, least recently activated first
        self._device: dict | None = None

    @property
    def num_slots(self) -> int:
        """Slots holding adapters, numbered from 1."""
        return self.max_loras

    def register(self, lora: LoRARequest) -> None:
        """Read and check a request's adapter (ValueError if it does not fit the model), once
        per adapter id."""
        if check_same_adapter(self.requests.get(lora.lora_int_id), lora):
            return
        self.adapters[lora.lora_int_id] = load_adapter(lora.lora_path, self.config,
                                                      self.max_lora_rank)
        self.requests[lora.lora_int_id] = lora

    def activate(self, lora_id: int, in_use: set[int]) -> int:
        """The slot of adapter `lora_id` (0 for no adapter), loading it into the least
        recently activated slot no adapter of `in_use` holds if it has none."""
        if not lora_id:
            return 0
        slot = self.slot_of.pop(lora_id, None)
        if slot is None:
            taken = set(self.slot_of.values())
            free = [i for i in range(1, self.num_slots + 1) if i not in taken]
            if free:
                slot = free[0]
            else:
                victim = next((lid for lid in self.slot_of if lid not in in_use), None)
                if victim is None:
                    raise RuntimeError(f"all {self.max_loras} LoRA slots hold adapters of "
                                       f"running requests; the scheduler admits at most "
                                       f"max_loras adapters at once")
                slot = self.slot_of.pop(victim)
            self._write(slot, self.adapters[lora_id])
        self.slot_of[lora_id] = slot
        return slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        r = self.max_lora_rank
        k = slot - 1
        for layer in self.host.values():
            for w in layer.values():
                w["A"][k] = 0
                w["B"][k] = 0
        for (i, name), (a, b) in adapter.weights.items():
            fused, part = FUSED_PARTS[name]
            _, parts, _ = self.layout[fused]
            _, col, width = parts[part]
            w = self.host[f"layers_{i}"][fused]
            w["A"][k, :, part * r:part * r + adapter.rank] = a.T
            w["B"][k, part * r:part * r + adapter.rank, col:col + width] = b.T
        self._device = None

    def device_weights(self) -> dict:
        """The slots' tree on the device (put there again after a slot changed)."""
        device = self._device
        if device is None:
            device = self._device = jax.device_put(
                jax.tree.map(lambda x: x.astype(self.dtype), self.host))
        return device

    def abstract(self) -> dict:
        """The tree's shapes and dtypes, for lowering the step."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, self.dtype), self.host)
