"""The GPU KV budget on CPU, from a fake device-memory source: gpu_memory_utilization of the
device less everything in use (this engine's weights counted once, another engine's weights and
KV, other arrays) and the activations; a budget under 2 blocks names its numbers."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxllm.config import kv_budget_bytes
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.kv_cache_groups import KVCacheGroups
from jaxllm.worker import model_runner as runner_module
from jaxllm.worker.model_runner import kv_block_bytes, num_kv_blocks_for
from tests.utils import make_llm

# 2 layers x (K, V) x 2 kv heads x 16 tokens x 8 dims x 4 bytes
CONFIG = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=8)
BLOCK = 2 * 2 * 2 * 16 * 8 * 4


def fake_runner(weights: int, activations: int, logits: int = 0) -> SimpleNamespace:
    return SimpleNamespace(local_config=CONFIG, kv_cache_dtype=np.float32,
                           kv_groups=KVCacheGroups.single(CONFIG.num_hidden_layers),
                           weight_bytes=lambda: weights,
                           measure_activation_bytes=lambda: activations,
                           logits_buffer_bytes=lambda: logits)


def gpu_config(tiny_path, **kw):
    return EngineArgs(model=str(tiny_path), **kw).create_engine_config("gpu")


def test_budget_subtracts_memory_in_use_once(monkeypatch, tiny_models):
    path = tiny_models["untied"][0]
    assert kv_block_bytes(CONFIG, 16, np.float32) == BLOCK
    total, weights, activations, logits = 1000 * BLOCK, 100 * BLOCK, 50 * BLOCK, 10 * BLOCK
    stats = {"bytes_limit": total, "bytes_in_use": weights}
    monkeypatch.setattr(runner_module, "device_memory_stats", lambda: dict(stats))
    config = gpu_config(path, gpu_memory_utilization=0.5)
    runner = fake_runner(weights, activations, logits)
    # Alone on the device: its weights are all that is in use, subtracted once.
    assert num_kv_blocks_for(config, runner) == 500 - 100 - 60 == 340

    # A second engine in this process: the first one's weights and 340 KV blocks are in use,
    # besides the second one's own weights.
    stats["bytes_in_use"] = (100 + 340 + 100) * BLOCK
    with pytest.raises(ValueError) as err:
        num_kv_blocks_for(config, runner)
    message = str(err.value)
    for number in (f"{total} device bytes", f"{540 * BLOCK} bytes in use",
                   f"{weights} of them this engine's weights", f"{60 * BLOCK} of activations",
                   "holds 0 blocks", f"of {BLOCK} bytes", "gpu_memory_utilization"):
        assert number in message, (number, message)

    # With more of the device allowed, the second engine gets what the first left.
    config = gpu_config(path, gpu_memory_utilization=0.9)
    assert num_kv_blocks_for(config, runner) == 900 - 540 - 60 == 300
    # Other arrays this process holds (a benchmark's buffers): in use is in use.
    stats["bytes_in_use"] = (540 + 298) * BLOCK
    assert num_kv_blocks_for(config, runner) == 900 - 838 - 60 == 2
    stats["bytes_in_use"] = (540 + 299) * BLOCK
    with pytest.raises(ValueError, match="holds 1 blocks"):
        num_kv_blocks_for(config, runner)
    # A reading that misses the weights (in use below them) still counts them.
    stats["bytes_in_use"] = 0
    assert num_kv_blocks_for(config, runner) == 900 - 100 - 60 == 740


def test_budget_arithmetic_is_one_function():
    budget, how = kv_budget_bytes(total=10_000, in_use=3_000, utilization=0.8, weights=1_000,
                                  activations=500)
    assert budget == 8_000 - 3_000 - 500 == 4_500
    assert "0.8 x 10000 device bytes - 3000 bytes in use (1000 of them" in how
    # In use under the weights: the weights count instead (never subtracted twice).
    assert kv_budget_bytes(10_000, 200, 0.8, 1_000, 500)[0] == 8_000 - 1_000 - 500


def test_second_engine_in_one_process_gets_what_the_first_left(monkeypatch, tiny_models):
    # The fake device reports what this process really holds: the bytes of the arrays that
    # came alive since the test began (other tests' fixtures keep theirs alive beside them).
    path = tiny_models["untied"][0]
    total = 64 << 20
    readings = []
    alive = jax.live_arrays()  # held, so that no new array can reuse one of their ids
    before = {id(x) for x in alive}

    def stats():
        readings.append(sum(x.nbytes for x in jax.live_arrays() if id(x) not in before))
        return {"bytes_limit": total, "bytes_in_use": readings[-1]}

    monkeypatch.setattr(runner_module, "device_memory_stats", stats)
    # The budget path in float32 on any platform: no test KV budget, no bfloat16 GPU default.
    sizing = dict(multiprocess_mode=False, num_kv_blocks=None, dtype="float32")
    first = make_llm(path, gpu_memory_utilization=0.3, **sizing)
    block = kv_block_bytes(first.llm_engine.model_config, 16, np.float32)
    weights = first.collective_rpc("weight_bytes")
    activations = (first.collective_rpc("measure_activation_bytes")
                   + first.collective_rpc("logits_buffer_bytes"))
    blocks = first.llm_engine.num_kv_blocks
    in_use = readings[-1]
    assert in_use >= weights
    assert blocks == (int(total * 0.3) - in_use - activations) // block > 100

    # Same share of the device: the first engine took it all.
    with pytest.raises(ValueError, match="bytes in use"):
        make_llm(path, gpu_memory_utilization=0.3, **sizing)
    second = make_llm(path, gpu_memory_utilization=0.6, **sizing)
    in_use2 = readings[-1]
    # The first engine's weights and KV array and the second's weights are all in use.
    assert in_use2 >= 2 * weights + blocks * block
    assert second.llm_engine.num_kv_blocks \
        == (int(total * 0.6) - in_use2 - activations) // block
    # Without the first engine's share it would have had room for 2 x `blocks` and more.
    assert second.llm_engine.num_kv_blocks < 2 * blocks - blocks // 2
    out = second.generate([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) > 0
