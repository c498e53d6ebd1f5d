"""KV cache groups from model configs: which layers share a block table, and where each keeps
its KV, against layouts worked out by hand (vLLM's hybrid allocator's grouping rule)."""

from __future__ import annotations

import pytest

from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.kv_cache_groups import KVCacheGroups, kv_cache_groups

BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 131072}


def gemma3(num_layers: int, window: int = 1024) -> ModelConfig:
    return ModelConfig.from_hf_config({
        **BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "head_dim": 32, "num_hidden_layers": num_layers, "sliding_window": window,
        "sliding_window_pattern": 6})


def qwen2(num_layers: int, max_window_layers: int, window: int = 4096) -> ModelConfig:
    return ModelConfig.from_hf_config({
        **BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "num_hidden_layers": num_layers, "use_sliding_window": True, "sliding_window": window,
        "max_window_layers": max_window_layers})


def check_layout(groups: KVCacheGroups, num_layers: int) -> None:
    """Every layer has one (group, slot), no two layers share one, and each group's layers
    have its window's kind."""
    assert len(groups.layer_group) == len(groups.layer_slot) == num_layers
    pairs = set(zip(groups.layer_group, groups.layer_slot, strict=True))
    assert len(pairs) == num_layers
    assert all(0 <= s < groups.num_slots for s in groups.layer_slot)
    assert set(groups.layer_group) == set(range(groups.num_groups))


def test_gemma3_27b_is_a_full_group_and_six_sliding_groups():
    # Layers 5, 11, ..., 59 are global (10 of 62): a full group of 10, then the 52 sliding
    # layers in order, 10 to a group, the last holding 2.
    cfg = gemma3(62)
    groups = kv_cache_groups(cfg, 131072)
    check_layout(groups, 62)
    full = [i for i in range(62) if i % 6 == 5]
    sliding = [i for i in range(62) if i % 6 != 5]
    assert groups.windows == (None,) + (1024,) * 6
    assert groups.num_slots == 10
    assert [groups.layer_group[i] for i in full] == [0] * 10
    assert [groups.layer_slot[i] for i in full] == list(range(10))
    assert [groups.layer_group[i] for i in sliding] == [1 + j // 10 for j in range(52)]
    assert [groups.layer_slot[i] for i in sliding] == [j % 10 for j in range(52)]


def test_counts_within_a_quarter_share_the_larger_size():
    # 13 full and 15 sliding layers: groups of 15 (two groups, 30 slots a position) rather
    # than of 13 (three groups, 39).
    groups = kv_cache_groups(qwen2(28, 13), 32768)
    check_layout(groups, 28)
    assert groups.windows == (None, 4096) and groups.num_slots == 15
    assert groups.layer_group == (0,) * 13 + (1,) * 15
    assert groups.layer_slot == tuple(range(13)) + tuple(range(15))
    # 13 and 17: a quarter apart or more, so groups of 13.
    groups = kv_cache_groups(qwen2(30, 13), 32768)
    check_layout(groups, 30)
    assert groups.windows == (None, 4096, 4096) and groups.num_slots == 13
    assert groups.layer_group == (0,) * 13 + (1,) * 13 + (2,) * 4


@pytest.mark.parametrize("max_model_len, windows", [(1024, (None,)), (1025, (None,) + (1024,) * 5)])
def test_a_window_the_context_never_exceeds_is_full_attention(max_model_len, windows):
    cfg = gemma3(12)
    assert kv_cache_groups(cfg, max_model_len).windows == windows


def test_one_group_where_every_layer_is_alike_or_hybrid_is_off():
    every_layer = ModelConfig.from_hf_config({
        **BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "num_hidden_layers": 4, "sliding_window": 64})
    for cfg, window in ((every_layer, 64), (qwen2(4, 4), None)):
        groups = kv_cache_groups(cfg, 4096)
        assert groups == KVCacheGroups.single(4, window)
        assert groups.layer_slot == (0, 1, 2, 3) and groups.num_slots == 4
    # A mixed model with hybrid off: one group of full attention, nothing freed.
    assert kv_cache_groups(gemma3(12), 4096, hybrid=False) == KVCacheGroups.single(12)
    # With hybrid off an all-sliding model keeps its window (its blocks still slide out).
    assert kv_cache_groups(every_layer, 4096, hybrid=False).windows == (64,)
