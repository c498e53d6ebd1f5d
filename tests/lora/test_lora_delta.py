"""The LoRA delta inside the step, with no adapter files: the per-slot conditional path against
the dense one and against numpy (each token through its own slot's A and B), and the CPU step
holding one conditional per slot and projection (the CUDA lowering holds none:
tests/kernels/test_lowering.py). The engine against Hugging Face is test_lora.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.lora.layers import lora_delta, lora_delta_used_slots
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from jaxllm.worker.model_runner import ModelRunner

NUM_SLOTS, NUM_TOKENS, D_IN, WIDTH, D_OUT = 4, 9, 40, 12, 56


def _numpy_delta(x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray) -> np.ndarray:
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    out = np.zeros((len(slots), b.shape[2]))
    for t, s in enumerate(slots):
        if s:
            out[t] = x[t] @ a[s - 1] @ b[s - 1]
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("slots", [
    [0] * NUM_TOKENS,  # no slot used
    [2, 0, 2, 0, 0, 2, 2, 0, 2],  # one slot of four
    [1, 0, 4, 4, 1, 0, 0, 1, 4],  # the first and the last
    [1, 2, 3, 4, 4, 3, 2, 1, 2],  # every slot
])
def test_used_slots_delta_is_the_dense_delta(slots: list[int], dtype) -> None:
    rng = np.random.default_rng(sum(slots))
    x = jnp.asarray(rng.normal(size=(NUM_TOKENS, D_IN)), dtype)
    a = jnp.asarray(rng.normal(size=(NUM_SLOTS, D_IN, WIDTH)) / np.sqrt(D_IN), dtype)
    b = jnp.asarray(rng.normal(size=(NUM_SLOTS, WIDTH, D_OUT)) / np.sqrt(WIDTH), dtype)
    token_slots = jnp.asarray(slots, jnp.int32)
    select = jax.nn.one_hot(token_slots - 1, NUM_SLOTS, dtype=jnp.float32)
    used = jnp.asarray([s in slots for s in range(1, NUM_SLOTS + 1)])
    got = np.asarray(jax.jit(lora_delta_used_slots)(x, a, b, select, used))
    dense = np.asarray(jax.jit(lora_delta)(x, a, b, select))
    assert got.dtype == dense.dtype == np.float32
    # The same products in float32 (bfloat16 inputs, the A product rounded to bfloat16 on
    # both sides), summed in another order.
    np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-5)
    oracle = _numpy_delta(np.asarray(x, np.float32), np.asarray(a, np.float32),
                          np.asarray(b, np.float32), np.asarray(slots))
    tol = 1e-4 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got, oracle, rtol=tol, atol=tol)
    assert not np.any(got[np.asarray(slots) == 0])
    if any(slots):
        assert np.abs(got).max() > 0.1
    # An unused slot is not read: NaN weights there (which the dense path's zero products
    # would carry into every token) change nothing.
    unused = np.asarray([s not in slots for s in range(1, NUM_SLOTS + 1)])
    a_nan = jnp.where(unused[:, None, None], jnp.nan, a).astype(dtype)
    b_nan = jnp.where(unused[:, None, None], jnp.nan, b).astype(dtype)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lora_delta_used_slots)(x, a_nan, b_nan, select, used)), got)


def _lora_runner(skip: bool | None) -> ModelRunner:
    loaded = load_model(tiny_qwen2_path(), dtype=jnp.float32, progress=False)
    return ModelRunner(loaded.config, loaded.params, dtype=jnp.float32,
                       kernel_backend="reference", block_size=16, max_model_len=64,
                       max_num_seqs=4, max_num_batched_tokens=32, max_loras=3,
                       max_lora_rank=4, lora_skip_unused_slots=skip)


def test_cpu_step_holds_a_conditional_per_slot_and_projection() -> None:
    runner = _lora_runner(None)  # resolved as the CPU engine's config resolves it
    assert runner.lora_skip_unused_slots and runner.lora_slots is not None
    weights = runner.lora_slots.device_weights()
    projections = sum(len(mods) for mods in weights.values())
    assert projections == 4 * runner.config.num_hidden_layers
    lowered = runner.lower_step(4, 1, 4)
    # A cond lowers to a case (what test_lowering.py looks for in the CUDA step) and compiles
    # to a conditional.
    assert lowered.as_text().count("stablehlo.case") == projections * 3
    assert lowered.compile().as_text().count(" conditional(") == projections * 3
    # The dense path (a GPU's): no conditional.
    dense = _lora_runner(False).lower_step(4, 1, 4).compile().as_text()
    assert " conditional(" not in dense
