"""How a model's layers share the paged KV array: KV cache groups (vLLM's hybrid KV cache
allocator).

A group is a set of layers with one attention window (None: the whole context) that share one
block table per request. With every layer alike there is one group and layer i keeps its KV at
index i of the array's layer axis. A model mixing full and sliding-window layers (Gemma 2 and 3,
Qwen2 with `max_window_layers`) gets groups of equal size, as many layers each as its rarer
kind has: the array's layer axis holds one group's worth of layers, and a block id names that
slice in every group, so all groups draw on one pool of blocks. A sliding group frees the blocks
behind its window as a request advances (scheduler/kv_cache_manager.py), so a long request holds
its whole context only in the full groups' blocks, and a block of the pool holds as many layers
as one group has instead of all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.model_executor.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window, None for full attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its index on the KV array's layer axis

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """The KV array's layer axis: the most layers one group has."""
        return max(self.layer_slot) + 1

    @staticmethod
    def single(num_layers: int, window: int | None = None) -> KVCacheGroups:
        """Every layer in one group, layer i at index i."""
        return KVCacheGroups((window,), (0,) * num_layers, tuple(range(num_layers)))


def kv_cache_groups(config: ModelConfig, max_model_len: int, hybrid: bool = True
                    ) -> KVCacheGroups:
    """The model's groups: one when its layers share a window (or none), or when `hybrid` is
    off (then a mixed model's sliding layers read fewer keys of the one table, whose blocks
    all stay). A window of at least max_model_len keys never slides, so it counts as full
    attention here. Group sizes follow vLLM's rule: the rarer kind's layer count, or the
    commoner kind's when it is less than a quarter larger (fewer groups, a few slots unused
    in the rarer kind's)."""
    num_layers = config.num_hidden_layers
    windows = []
    for i in range(num_layers):
        w = config.layer_sliding_window(i)
        windows.append(w if w is not None and w < max_model_len else None)
    kinds = sorted(set(windows), key=lambda w: -1 if w is None else w)
    if len(kinds) == 1:
        return KVCacheGroups.single(num_layers, kinds[0])
    if not hybrid:
        return KVCacheGroups.single(num_layers)
    layers_of = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    counts = [len(layers) for layers in layers_of.values()]
    size = min(counts)
    if max(counts) < size * 1.25:
        size = max(counts)
    group_windows: list[int | None] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for kind in kinds:
        layers = layers_of[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(kind)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot))
