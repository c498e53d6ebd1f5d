"""The adapters the step can read: per decoder layer and fused projection, A [S, in, width]
and B [S, width, out] over S = max_loras slots; a token's slot is 1..S, or 0 for a request
without an adapter, which reads none of them (a GPU's step reads every slot's weights, so a
zero slot would cost as much as a real one). A fused projection's parts (q, k, v; gate, up) each
own `max_lora_rank` columns of A and rows of B, so B is block-diagonal over the parts and one
contraction serves them all; a model whose checkpoints store the projection fused (Phi-3's
`qkv_proj`, `gate_up_proj`) has adapters on the whole of it, one part whose B rows span every
output column. Ranks below the maximum are zero-padded, the scaling is in B.

Slots are filled least recently activated first, never one a live request reads (the
scheduler keeps the adapters of running requests within max_loras). A fill happens when a
request with an adapter not in a slot starts, and requests already running wait for it: so it
builds only that slot's A and B on the host, in the slots' dtype, and one compiled update
writes them into the device tree in place (the tree is donated, the slot index traced, so one
executable serves every slot). The update returns new arrays; the steps bound to the old
ones must be rebound before they run again (`ModelRunner._activate_loras`).

On the host, at most max_cpu_loras adapters stay read (vLLM's `max_cpu_loras`), least recently
requested dropped first, but never one an unfinished request names: its request pins it from
being queued (`pin`) until it finishes or is aborted (`unpin`), as a slot load reads the host
copy. An adapter dropped from the host gives up its slot too; its next request reads the
directory again (when the request is added, never in a step) and loads a slot from that read,
so an id runs the weights last read for it. An adapter id keeps its directory for the engine's
life, cached or not, so an id naming another directory later is refused as it would be while
cached.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.lora.adapter import LoRAAdapter, load_adapter, lora_parts, module_dims
from jaxllm.lora.request import LoRARequest, check_same_adapter
from jaxllm.model_executor.config import ModelConfig


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_lora_rank: int,
                 dtype: Any, max_cpu_loras: int | None = None) -> None:
        """`max_cpu_loras`: most adapters kept read on the host (None: max_loras)."""
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and "
                             f"{max_lora_rank}")
        if max_cpu_loras is None:
            max_cpu_loras = max_loras
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras "
                             f"({max_loras})")
        self.config = config
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        dims = module_dims(config)
        # PEFT module name -> (parent, fused projection, part), parts in output order.
        self.parts = lora_parts(config)
        # fused name -> (in, [(PEFT part, first output column, width)], out)
        self.layout: dict[str, tuple[int, list[tuple[str, int, int]], int]] = {}
        for name, (_, fused, _) in self.parts.items():
            d_in, offsets, col = self.layout.get(fused, (dims[name][0], [], 0))
            offsets.append((name, col, dims[name][1]))
            self.layout[fused] = (d_in, offsets, col + dims[name][1])
        # Every adapter id registered -> its first request (the directory the id names).
        self.requests: dict[int, LoRARequest] = {}
        # The adapters read, least recently registered first. Those of unfinished requests
        # are always here: a slot load inside a step never reads the disk, where a file
        # deleted or rewritten since would fail the step (or change the weights behind blocks
        # the prefix cache keys on the adapter's id).
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._pinned_by: dict[str, int] = {}  # unfinished request id -> its adapter id
        self._pins: Counter[int] = Counter()  # adapter id -> unfinished requests naming it
        self.slot_of: dict[int, int] = {}  # adapter id -> slot, least recently activated first
        self._device: dict | None = None
        self._update: Any = None  # the compiled one-slot write (`compile_update`)

    @property
    def num_slots(self) -> int:
        """Slots holding adapters, numbered from 1."""
        return self.max_loras

    def register(self, lora: LoRARequest) -> None:
        """Read and check a request's adapter (ValueError if it does not fit the model, or if
        its id names another directory) unless it is kept read; it becomes the most recently
        used one, and the least recently used unpinned ones beyond max_cpu_loras are dropped."""
        lid = lora.lora_int_id
        known = check_same_adapter(self.requests.get(lid), lora)
        if lid in self.adapters:
            self.adapters.move_to_end(lid)
            return
        self.add_adapter(lid, load_adapter(lora.lora_path, self.config, self.max_lora_rank))
        if not known:
            self.requests[lid] = lora
        self._evict(keep=lid)

    def pin(self, request_id: str, lora_id: int) -> None:
        """Keep adapter `lora_id` (registered) read while request `request_id`, queued after
        every check, is unfinished (the engine core refuses an id already unfinished)."""
        self._pinned_by[request_id] = lora_id
        self._pins[lora_id] += 1

    def unpin(self, request_ids: list[str]) -> None:
        """Requests that finished or were aborted (ids pinning nothing are skipped); their
        adapters may be dropped now, least recently used first."""
        for rid in request_ids:
            lid = self._pinned_by.pop(rid, None)
            if lid is not None:
                self._pins[lid] -= 1
                if not self._pins[lid]:
                    del self._pins[lid]
        self._evict()

    def _evict(self, keep: int = 0) -> None:
        """Drop the least recently used adapters beyond max_cpu_loras that no unfinished
        request pins, nor `keep` (just read: its request is being added)."""
        # With more adapters pinned than max_cpu_loras (requests queued behind max_loras),
        # the cache stays above the bound, rather than refusing requests, until `unpin` trims
        # it as they finish.
        excess = len(self.adapters) - self.max_cpu_loras
        if excess <= 0:
            return
        for lid in [lid for lid in self.adapters if lid not in self._pins and lid != keep
                    ][:excess]:
            del self.adapters[lid]
            # Its slot is free again (no unfinished request reads it): the adapter's next
            # request reads its directory again, and its slot is loaded from that read, so an
            # id never runs weights other than those last read for it.
            self.slot_of.pop(lid, None)

    def add_adapter(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Keep a read adapter for its slot loads, its matrices cast to the slots' dtype
        once (a bfloat16 engine holds half the bytes, and a load casts nothing)."""
        dtype = np.dtype(self.dtype)
        self.adapters.pop(lora_id, None)
        self.adapters[lora_id] = LoRAAdapter(adapter.rank, adapter.scale, {
            key: (a.astype(dtype, copy=False), b.astype(dtype, copy=False))
            for key, (a, b) in adapter.weights.items()})

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

    def _shapes(self) -> dict:
        """Each leaf's shape in one slot: A [in, width], B [width, out]."""
        r = self.max_lora_rank
        return {f"layers_{i}": {fused: {"A": (d_in, len(parts) * r),
                                        "B": (len(parts) * r, d_out)}
                                for fused, (d_in, parts, d_out) in self.layout.items()}
                for i in range(self.config.num_hidden_layers)}

    def slot_weights(self, adapter: LoRAAdapter) -> dict:
        """One slot's host arrays for `adapter`, in the slots' dtype: each part's A columns
        and B rows at its place in the fused projection, zeros elsewhere."""
        r = self.max_lora_rank
        dtype = np.dtype(self.dtype)
        tree = jax.tree.map(lambda shape: np.zeros(shape, dtype), self._shapes(),
                            is_leaf=_is_shape)
        for (i, name), (a, b) in adapter.weights.items():
            _, fused, part = self.parts[name]
            _, col, width = self.layout[fused][1][part]
            w = tree[f"layers_{i}"][fused]
            # No cast for an adapter kept by `add_adapter`; another is cast per matrix before
            # its strided copy into place (faster than casting in the copy).
            w["A"][:, part * r:part * r + adapter.rank] = a.T.astype(dtype, copy=False)
            w["B"][part * r:part * r + adapter.rank, col:col + width] = \
                b.T.astype(dtype, copy=False)
        return tree

    def compile_update(self) -> Any:
        """The executable writing one slot into the device tree (compiled on first use; the
        runner compiles it with its steps, so that serving compiles nothing)."""
        if self._update is None:
            slot = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, self.dtype),
                                self._shapes(), is_leaf=_is_shape)
            self._update = jax.jit(_set_slot, donate_argnums=0).lower(
                self.abstract(), slot, jax.ShapeDtypeStruct((), np.int32)).compile()
        return self._update

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        update = self.compile_update()
        tree = self.device_weights()
        # Only this slot crosses to the device; the other slots stay where they are.
        weights, index = jax.device_put((self.slot_weights(adapter), np.int32(slot - 1)))
        self._device = update(tree, weights, index)

    def device_weights(self) -> dict:
        """The slots' tree on the device: a new tree after each slot write, the one before it
        donated to the write (no longer readable)."""
        device = self._device
        if device is None:
            device = self._device = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                                 self.abstract())
        return device

    def abstract(self) -> dict:
        """The tree's shapes and dtypes, for lowering the step."""
        s = self.max_loras
        return jax.tree.map(lambda shape: jax.ShapeDtypeStruct((s, *shape), self.dtype),
                            self._shapes(), is_leaf=_is_shape)


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def _set_slot(tree: dict, slot: dict, index: jax.Array) -> dict:
    return jax.tree.map(lambda t, w: t.at[index].set(w), tree, slot)
