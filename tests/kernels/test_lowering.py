"""Every kernel lowers through Pallas -> Triton for CUDA at Qwen2 shapes (no GPU needed), and a
model step holds one Triton module per kernel kind whatever its number of layers."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from jaxllm.model_executor.config import ModelConfig
from jaxllm.worker.lowering import lower_step_for_cuda
from pallas_kernels.checks.check_lowering import (
    DTYPES,
    KERNEL_MODULES,
    MODEL_SHAPES,
    TRITON_CALL,
    format_table,
    iter_cases,
    run_checks,
    triton_modules,
)
from pallas_kernels.checks.lowering_cases import (
    LARGE_KV_BYTES,
    LARGE_KV_SUFFIX,
    kv_arrays,
    kv_write_cases,
    paged_attention_cases,
)
from pallas_kernels.checks.shapes import QWEN2_SHAPES
from pallas_kernels.checks.triton_compile import lowered_triton_kernels, triton_kernels
from pallas_kernels.common import lower_for_cuda


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_windowed_attention_lowers_for_cuda(phase: str) -> None:
    # Paged attention and split-K decode with a sliding window (Mistral's size) at the
    # smallest model's shapes, both dtypes: masks and the window's first key tile lower too.
    for dtype in (jnp.bfloat16, jnp.float32):
        for name, fn, args in paged_attention_cases(QWEN2_SHAPES["qwen2.5-0.5b"], dtype, phase,
                                                    sliding_window=4096):
            assert TRITON_CALL in lower_for_cuda(fn, args).as_text(), name


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_soft_capped_attention_lowers_for_cuda(phase: str) -> None:
    # With Gemma 2's logit soft cap (and its window) every kernel that computes logits lowers
    # a tanh; without the cap none does (the uncapped kernels are unchanged).
    model = QWEN2_SHAPES["qwen2.5-0.5b"]
    for cap in (50.0, None):
        for name, fn, args in paged_attention_cases(model, jnp.bfloat16, phase,
                                                    sliding_window=4096, logits_soft_cap=cap):
            for kernel in triton_kernels(fn, args):
                logits = kernel.name != "paged_attention_combine"
                assert ("tanh" in kernel.ttir) == (cap is not None and logits), (name,
                                                                                   kernel.name)


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_lowers_for_cuda(module: str) -> None:
    results = run_checks([module])
    assert results, f"{module} produced no lowering cases"
    failed = [r for r in results if not r.ok]
    assert not failed, "\n" + format_table(failed)


def test_kv_arrays_over_4_gib_for_every_model_and_dtype() -> None:
    # Every model's write_kv and attention cases include a KV array over 4 GiB (64-bit
    # offsets): the usual one where it is that large, else an extra H100-sized one.
    four_gib = 2**32
    for model in QWEN2_SHAPES.values():
        for dtype in DTYPES:
            arrays = kv_arrays(model, dtype, 16)
            sizes = [math.prod(shape) * jnp.dtype(dtype).itemsize for _, shape in arrays]
            assert arrays[0][0] == "" and max(sizes) > four_gib
            if sizes[0] <= four_gib:
                assert [s for s, _ in arrays] == ["", LARGE_KV_SUFFIX]
                assert LARGE_KV_BYTES - sizes[0] / arrays[0][1][3] < sizes[1] <= LARGE_KV_BYTES
            else:
                assert len(arrays) == 1
    # Qwen2.5-0.5B in bfloat16 is the one whose usual array (3.2 GB) is under 4 GiB.
    small = kv_arrays(QWEN2_SHAPES["qwen2.5-0.5b"], jnp.bfloat16, 16)
    assert len(small) == 2
    names = {c.kernel for c in iter_cases(["kv_write", "paged_attention"], MODEL_SHAPES[:1],
                                          [jnp.bfloat16], ["decode1"])}
    assert names == {"write_kv", "write_kv_kv60g", "paged_attention_bs16",
                     "paged_attention_bs16_kv60g", "paged_attention_splitk_bs16",
                     "paged_attention_splitk_bs16_kv60g"}


def test_large_kv_cases_take_64_bit_offsets() -> None:
    # The _kv60g cases exist for their addressing: their KV loads and stores go through 64-bit
    # pointer offsets, the usual (3.2 GB) array's through 32-bit ones. The combine kernel never
    # touches the KV array.
    model = QWEN2_SHAPES["qwen2.5-0.5b"]
    cases = kv_write_cases(model, jnp.bfloat16, "decode1") + paged_attention_cases(
        model, jnp.bfloat16, "decode1")
    seen = set()
    for name, fn, args in cases:
        for kernel in triton_kernels(fn, args):
            wide = any("tt.addptr" in line and "i64" in line for line in kernel.ttir.splitlines())
            touches_kv = kernel.name != "paged_attention_combine"
            assert wide == (name.endswith(LARGE_KV_SUFFIX) and touches_kv), (name, kernel.name)
            seen.add((name, kernel.name))
    assert len(seen) == 8


def test_missing_module_is_reported_not_raised() -> None:
    (result,) = run_checks(["no_such_kernel"])
    assert not result.ok and result.error.startswith("missing")


# The kernel kinds of a bf16 step of the model: the norms (the first layer's input norm alone,
# then fused with the residual add), the QKV epilogue (bias, RoPE and the KV write in one
# kernel) and attention (split-K decode: split and combine kernels; a prefill bucket or a
# speculative-decoding verify bucket: the one-pass kernel).
NORMS_ROPE_WRITE = {"rms_norm", "rms_norm_residual", "rope_write_kv"}
STEP_KERNELS = {
    "decode": NORMS_ROPE_WRITE | {"paged_attention_split", "paged_attention_combine"},
    "prefill": NORMS_ROPE_WRITE | {"paged_attention"},
    "spec": NORMS_ROPE_WRITE | {"paged_attention"},
}
SPEC_QUERY_LEN = 6  # 1 + k, k = 5 draft tokens


def _step_config(num_layers: int) -> ModelConfig:
    shape = QWEN2_SHAPES["qwen2.5-0.5b"]
    return ModelConfig.from_hf_config(shape.hf_config(num_hidden_layers=num_layers,
                                                      vocab_size=1024, rope_theta=1e6))


@pytest.mark.parametrize("phase, num_tokens", [("decode", 8), ("prefill", 64),
                                               ("spec", 8 * SPEC_QUERY_LEN)])
def test_model_step_has_one_triton_module_per_kernel_kind(phase, num_tokens) -> None:
    # 3 layers at Qwen2.5-0.5B widths: each layer calls rope_write_kv and attention, yet XLA
    # gets one distinct Triton module per kernel kind to compile (with the layer a constant of
    # the kernels, they would be 3 modules each).
    num_layers = 3
    config = _step_config(num_layers)
    lowered = lower_step_for_cuda(config, num_tokens, phase != "prefill",
                                  query_len=SPEC_QUERY_LEN if phase == "spec" else 1)
    counts = triton_modules(lowered)
    assert counts.modules == dict.fromkeys(STEP_KERNELS[phase], 1)
    attention = "paged_attention_split" if phase == "decode" else "paged_attention"
    assert counts.ops["rope_write_kv"] == counts.ops[attention] == num_layers
    if phase == "spec":
        # 8 sequences of 6 tokens at max_query_len 6: the attention grid (sequences, query
        # tiles, KV heads) has one tile of 8 tokens x 8 (padded) heads per sequence on 4 warps
        # (a prefill-shaped call, max_query_len 48, would launch 3 tiles of 16 tokens on 8),
        # and every token has a logits row.
        (attn,) = {(k.grid, k.num_warps) for k in lowered_triton_kernels(lowered)
                   if k.name == attention}
        assert attn == ((8, 1, 2), 4)
        assert lowered.out_info[3].shape == (num_tokens, config.vocab_size)


def test_step_with_lora_slots_lowers_with_the_same_kernels() -> None:
    # LoRA adds XLA matmuls beside the projections: the Pallas kernels are the plain step's.
    # Every slot is computed, with no conditional (whose predicate a GPU reads on the host;
    # the CPU step's conditionals: tests/lora/test_lora_delta.py).
    config = _step_config(2)
    plain = triton_modules(lower_step_for_cuda(config, 8, True))
    lowered = lower_step_for_cuda(config, 8, True, lora=(2, 16))
    assert triton_modules(lowered) == plain
    text = lowered.as_text()
    assert text.count("stablehlo.dot_general") > \
        lower_step_for_cuda(config, 8, True).as_text().count("stablehlo.dot_general")
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_step_query_len_is_checked() -> None:
    config = _step_config(1)
    for num_tokens, decode, query_len in ((48, True, 5), (48, False, 6), (48, True, 0)):
        with pytest.raises(ValueError, match="query_len"):
            lower_step_for_cuda(config, num_tokens, decode, query_len=query_len)
    with pytest.raises(ValueError, match=r"holds 8 sequences, more than max_num_seqs \(4\)"):
        lower_step_for_cuda(config, 48, True, query_len=6, max_num_seqs=4)


def test_hybrid_kv_cache_step_lowers_with_the_same_kernels() -> None:
    # Two full and two sliding layers (Qwen2's max_window_layers): hybrid, the KV array holds
    # two layers per block and the block tables and slot mapping lead with a group axis; the
    # Triton modules and their calls are those of the one-group layout.
    shape = QWEN2_SHAPES["qwen2.5-0.5b"]
    config = ModelConfig.from_hf_config(shape.hf_config(
        num_hidden_layers=4, vocab_size=1024, rope_theta=1e6, use_sliding_window=True,
        sliding_window=64, max_window_layers=2))
    assert [config.layer_sliding_window(i) for i in range(4)] == [None, None, 64, 64]
    hybrid = lower_step_for_cuda(config, 8, True)
    single = lower_step_for_cuda(config, 8, True, hybrid_kv_cache=False)
    for lowered, layers, g in ((hybrid, 2, (2,)), (single, 4, ())):
        args = lowered.args_info[0]
        kv, metadata = args[2], args[5]
        assert kv.shape[0] == layers
        assert metadata.block_tables.shape == (*g, 8, 4096 // 16)
        assert metadata.slot_mapping.shape == (*g, 8)
    counts = triton_modules(hybrid)
    assert counts == triton_modules(single)
    assert counts.ops["rope_write_kv"] == counts.ops["paged_attention_split"] == 4
