"""quantization="gguf": GGUF blocks kept quantized (int8 + per-block f32 scale/offset).

Exactness per format (no model): the repacked blocks dequantize, in numpy and in jitted JAX, to
bit-for-bit the float32 values `gguf.quants.dequantize` gives, signed zeros included. Then the
fused GEMV (one per row: each row's result does not depend on the other rows), the CPU kernel's
panel layout (the kernel's own tests: tests/kernels/test_cpu_dequant_matmul.py), and a tiny
2-layer Qwen2 GGUF using every supported format end to end against transformers holding gguf's
dequantized weights: logits, greedy tokens, and the same tokens alone or in a batch.
"""

from __future__ import annotations

import argparse

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.model_executor.layers.linear import linear
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from jaxllm.model_executor.layers.quantization.gguf import (
    GGUFWeight,
    dequantize,
    gemv_chunks,
    gguf_linear,
)
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.model_loader import gguf_repack
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from tests.gguf_models import hf_model_from, quantized_bytes, random_blocks, write_tiny_gguf
from tests.model_inputs import prefill_inputs
from tests.utils import hf_greedy_tokens, kv_budget_kwargs, runner_of


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _device(r: gguf_repack.RepackedBlocks, packed: bool = False) -> GGUFWeight:
    arrays = cpu_dequant_matmul.pack(r.qweight, r.scale, r.offset) if packed \
        else (r.qweight, r.scale, r.offset)
    return GGUFWeight(*(None if a is None else jnp.asarray(a) for a in arrays))


def _quantized(tree) -> list[GGUFWeight]:
    return [w for w in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, GGUFWeight))
            if isinstance(w, GGUFWeight)]


def _check_exact(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> None:
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).reshape(shape)
    r = gguf_repack.repack(raw, fmt, shape, "t")
    assert r.qweight.dtype == np.int8 and r.scale.dtype == np.float32
    assert r.block_size in (16, 32)
    np.testing.assert_array_equal(_bits(gguf_repack.dequantize(r)), _bits(want))
    rows = jnp.asarray([3, 0, 3, shape[0] - 1], jnp.int32)  # an embedding gather
    # Rows, and the CPU kernel's panels where the rows split into them.
    for packed in (False, True) if cpu_dequant_matmul.panel_size(shape[0]) else (False,):
        w = _device(r, packed)
        np.testing.assert_array_equal(_bits(jax.jit(dequantize)(w)), _bits(want))
        np.testing.assert_array_equal(_bits(jax.jit(dequantize)(w, rows)),
                                      _bits(want[np.asarray(rows)]))


@pytest.mark.parametrize("fmt", gguf_repack.SUPPORTED_TYPES)
def test_repack_is_bit_exact(fmt, rng):
    # Random bytes cover every bit pattern of the values and 6-bit scales / mins; the f16
    # scale fields are random finite values, with +0.0 and -0.0 among them.
    _check_exact(random_blocks(rng, fmt, 24, 512, signed_zeros=True), fmt, (24, 512))
    # gguf's own quantizer, where it has one, on normal weights.
    _check_exact(quantized_bytes(rng, fmt, 8, 512), fmt, (8, 512))


def test_fused_rows_of_mixed_formats_are_bit_exact(rng):
    """q/k/v (or gate/up) stacked from 16- and 32-value blocks, with and without offsets."""
    parts = [("Q6_K", 16), ("Q4_K", 8), ("Q8_0", 8), ("Q5_0", 4)]
    raws = [random_blocks(rng, fmt, rows, 256, signed_zeros=True) for fmt, rows in parts]
    fused = gguf_repack.concat_rows([gguf_repack.repack(raw, fmt, (rows, 256))
                                     for raw, (fmt, rows) in zip(raws, parts, strict=True)])
    assert fused.block_size == 16 and fused.offset is not None
    want = np.concatenate([gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
                           for raw, (fmt, _) in zip(raws, parts, strict=True)])
    np.testing.assert_array_equal(_bits(gguf_repack.dequantize(fused)), _bits(want))
    np.testing.assert_array_equal(_bits(jax.jit(dequantize)(_device(fused))), _bits(want))


def test_unsupported_type_names_tensor_and_type(rng):
    raw = quantized_bytes(rng, "Q4_1", 4, 64)
    with pytest.raises(gguf_repack.UnsupportedGGUFType, match=r"blk\.3\.ffn_up\.weight.*Q4_1"):
        gguf_repack.repack(raw, "Q4_1", (4, 64), "blk.3.ffn_up.weight")


def _materialized(compiled_text: str, weights: list[GGUFWeight]) -> list[str]:
    """Instructions of a compiled step that hold a whole dequantized weight (either layout)."""
    shapes = {f"f32[{o},{i}]" for w in weights for o, i in (w.shape, w.shape[::-1])}
    entry = compiled_text[compiled_text.index("ENTRY"):]
    return [line for line in entry.splitlines() if "parameter(" not in line
            and any(f" = {s}" in line for s in shapes)]


@pytest.mark.parametrize("fmt,shape", [("Q4_K", (384, 512)), ("Q6_K", (64, 4608))])
def test_xla_gemv_rows_do_not_depend_on_the_batch(fmt, shape, rng, monkeypatch):
    """XLA's fused GEMV, the path where our CPU kernel cannot be built (the kernel's own tests:
    test_cpu_dequant_matmul.py): weights exactly gguf's inside the dot; row i's result is
    bit-identical whatever rows share the bucket (the float32 GEMM's is not); the summation
    order differs from the float32 path's, so only closeness to it is claimed. 4608-wide rows
    are over XLA's fusion limit and run in two chunks; neither shape materialises the float32
    weight."""
    monkeypatch.setattr(cpu_dequant_matmul, "available", lambda: False)
    r = gguf_repack.repack(random_blocks(rng, fmt, *shape), fmt, shape)
    w, dense = _device(r), jnp.asarray(gguf_repack.dequantize(r))
    assert len(gemv_chunks(shape[1], w.block_size)) == (1 if shape[1] < 4096 else 2)
    x = jnp.asarray(rng.standard_normal((8, shape[1])).astype(np.float32))
    # New functions, not jax.jit(gguf_linear): jit caches a function's trace, which may be
    # another test's, made with the kernel.
    xla_linear = jax.jit(lambda x, w: gguf_linear(x, w))
    full = np.asarray(xla_linear(x, w))
    for rows in (1, 2, 4):
        np.testing.assert_array_equal(np.asarray(xla_linear(x[:rows], w)), full[:rows])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w)),
                                  full)  # the dispatch
    want = np.asarray(jax.jit(linear)(x, dense))
    np.testing.assert_allclose(full, want, rtol=0, atol=1e-5 * np.abs(want).max())
    text = xla_linear.lower(x[:2], w).compile().as_text()
    assert "jaxllm_dequant_matmul" not in text and not _materialized(text, [w])


# --- a tiny GGUF end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    return path, hf_model_from(write_tiny_gguf(path))


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "xla-gemv"])
def test_tiny_gguf_trees_match_hf(tiny_gguf, cpu_kernel, monkeypatch):
    """With our CPU kernel one tree, every block weight packed for it; without, a GEMV tree
    beside float32 copies. Every tree against transformers."""
    if not cpu_kernel:
        monkeypatch.setattr(cpu_dequant_matmul, "available", lambda: False)
    elif not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    path, hf = tiny_gguf
    loaded = load_model(path, progress=False, quantization="gguf",
                        gguf_layout="panels" if cpu_kernel else "rows")
    if cpu_kernel:
        assert loaded.gemv_params is None
        quantized, trees = loaded.params, (loaded.params,)
        assert all(w.packed for w in _quantized(quantized))
        assert len(_quantized(quantized)) == 4 + 3 + 2  # embedding and LM head included
    else:
        quantized, trees = loaded.gemv_params, (loaded.params, loaded.gemv_params)
        assert not isinstance(loaded.params["lm_head"], GGUFWeight)  # float32 for its GEMM
        assert isinstance(loaded.params["embed_tokens"], GGUFWeight)  # untied: gathered
    # Every block weight is quantized (all are narrow enough for XLA's GEMVs here) but the
    # float16 o_proj of layer 1.
    assert isinstance(quantized["layers_0"]["self_attn"]["o_proj"]["weight"], GGUFWeight)
    assert isinstance(quantized["layers_1"]["mlp"]["down_proj"]["weight"], GGUFWeight)
    assert not isinstance(quantized["layers_1"]["self_attn"]["o_proj"]["weight"], GGUFWeight)
    assert isinstance(quantized["lm_head"], GGUFWeight)
    prompts = [[1, 5, 9, 100, 200], list(range(30, 37))]
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    with torch.no_grad():
        want = np.concatenate([hf(torch.tensor([p])).logits[0].numpy() for p in prompts])
    model = Qwen2ForCausalLM(loaded.config)
    for tree in trees:
        logits, _, _ = jax.jit(model.apply)({"params": tree, "rope": rope_variables(
            loaded.config)}, ids, pos, kv, md)
        np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4)


def test_rows_no_panel_splits_stay_float32(tiny_gguf, monkeypatch):
    """With our CPU kernel, a weight whose rows no panel width divides stays float32 in the one
    tree (here the vocabulary's: the embedding table and the LM head), the rest quantized, and
    the model still matches transformers."""
    if not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    path, hf = tiny_gguf
    vocab, panel_size = hf.config.vocab_size, cpu_dequant_matmul.panel_size
    monkeypatch.setattr(cpu_dequant_matmul, "panel_size",
                        lambda rows: None if rows == vocab else panel_size(rows))
    loaded = load_model(path, progress=False, quantization="gguf", gguf_layout="panels")
    tree = loaded.params
    assert loaded.gemv_params is None
    assert not isinstance(tree["lm_head"], GGUFWeight)
    assert not isinstance(tree["embed_tokens"], GGUFWeight)
    quantized = _quantized(tree)
    assert quantized and all(w.packed and w.shape[0] != vocab for w in quantized)
    prompts = [[1, 5, 9, 100, 200]]
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    with torch.no_grad():
        want = hf(torch.tensor(prompts)).logits[0].numpy()
    logits, _, _ = jax.jit(Qwen2ForCausalLM(loaded.config).apply)(
        {"params": tree, "rope": rope_variables(loaded.config)}, ids, pos, kv, md)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4)


def test_gguf_compact_same_logits_in_fewer_bytes(tiny_gguf, rng):
    """gguf_compact packs the Q4_0 / Q5_0 / Q4_K values in 5 bits: fewer bytes, the logits bit
    for bit those of the int8 panels (one row, unpacked in registers; many, unpacked per item),
    the embedding's gathers included; the engine loads it and decodes transformers' tokens."""
    if not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    path, hf = tiny_gguf
    int8 = load_model(path, progress=False, quantization="gguf", gguf_layout="panels")
    compact = load_model(path, progress=False, quantization="gguf", gguf_layout="compact")
    five = [w for w in _quantized(compact.params) if cpu_dequant_matmul.is_q5(w.qweight)]
    assert five and not any(cpu_dequant_matmul.is_q5(w.qweight) for w in _quantized(int8.params))
    assert cpu_dequant_matmul.is_q5(compact.params["embed_tokens"].qweight)  # Q5_0
    assert all(w.qweight.nbytes * 64 == w.shape[0] * w.shape[1] * 40 for w in five)
    size = [sum(w.nbytes for w in _quantized(t.params)) for t in (int8, compact)]
    assert size[1] < size[0]
    model = Qwen2ForCausalLM(int8.config)
    for prompts in ([[7]], [[1, 5, 9, 100, 200], list(range(30, 37))]):
        ids, pos, kv, md = prefill_inputs(int8.config, prompts)
        logits = [np.asarray(jax.jit(model.apply)(
            {"params": t.params, "rope": rope_variables(t.config)}, ids, pos, kv, md)[0])
            for t in (int8, compact)]
        np.testing.assert_array_equal(logits[1], logits[0])
    llm = LLM(model=str(path), quantization="gguf", gguf_compact=True, skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, show_progress=False,
              multiprocess_mode=False, **kv_budget_kwargs())
    assert any(cpu_dequant_matmul.is_q5(w.qweight) for w in _quantized(runner_of(llm).params))
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 19)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf_greedy_tokens(hf, list(prompt), 12)
        assert out.outputs[0].token_ids == ref


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "xla-gemv"])
def test_tiny_gguf_greedy_matches_hf_alone_and_batched(tiny_gguf, rng, cpu_kernel, monkeypatch):
    """Both CPU paths: our kernel, and XLA's fused GEMVs where it cannot be built."""
    if not cpu_kernel:
        monkeypatch.setattr(cpu_dequant_matmul, "available", lambda: False)
    elif not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    path, hf = tiny_gguf
    # In process: the kernel's availability is patched in this process, and the test reads
    # the runner's weight trees and executables.
    llm = LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=32, show_progress=False,
              multiprocess_mode=False, **kv_budget_kwargs())
    runner = runner_of(llm)
    # The kernel: one quantized tree for every bucket; XLA: the GEMV tree for small decode
    # buckets only.
    gemv = runner.params if cpu_kernel else runner.gemv_params
    assert runner.params_for(1, 1) is gemv and runner.params_for(4, 1) is gemv
    assert runner.params_for(16, 16) is (gemv if cpu_kernel else runner.params)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 17, 30, 9)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert runner.step_shape_counts[(4, 1)] > 0  # the batch decoded in the 4-row bucket
    runner.step_shape_counts.clear()
    for prompt, out in zip(prompts, batched, strict=True):
        alone = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf_greedy_tokens(hf, list(prompt), 16)
        assert out.outputs[0].token_ids == ref
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    assert set(runner.step_shape_counts) <= {(1, 1), (16, 16), (32, 32)}
    # No dequantized weight materialised: the kernel's custom calls, or XLA fused every
    # dequantization into its GEMV (biases included: see Linear).
    quantized = _quantized(gemv)
    assert len(quantized) == 4 + 3 + 2  # 4 per layer (layer 1 o_proj: F16), embedding, head
    for shape in ((1, 1), (4, 1)) + (((16, 16), (32, 32)) if cpu_kernel else ()):
        text = runner.get_compiled_hlo(*shape)
        assert not _materialized(text, quantized)
        assert ("jaxllm_dequant_matmul" in text) == cpu_kernel


@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["cpu-kernel", "xla-gemv"])
def test_tied_gguf_head_is_the_quantized_table(tmp_path, cpu_kernel, monkeypatch):
    """Tied embeddings: the quantized tree's LM head is the quantized table itself (packed for
    our CPU kernel); the same logits up to rounding as the dense float32 load, and the table
    the same values bit for bit. Without the kernel the float32 tree beside the GEMV tree keeps
    a float32 table for its GEMM."""
    if not cpu_kernel:
        monkeypatch.setattr(cpu_dequant_matmul, "available", lambda: False)
    elif not cpu_dequant_matmul.available():
        pytest.skip("no C++ compiler to build the CPU kernel")
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, seed=3, tied=True)
    loaded = load_model(path, progress=False, quantization="gguf",
                        gguf_layout="panels" if cpu_kernel else "rows")
    dense = load_model(path, progress=False).params
    quantized = loaded.params if cpu_kernel else loaded.gemv_params
    assert loaded.config.tie_word_embeddings and "lm_head" not in quantized
    table = quantized["embed_tokens"]
    assert isinstance(table, GGUFWeight) and table.packed == cpu_kernel
    assert cpu_kernel or not isinstance(loaded.params["embed_tokens"], GGUFWeight)
    np.testing.assert_array_equal(_bits(dequantize(table)), _bits(dense["embed_tokens"]))
    ids, pos, kv, md = prefill_inputs(loaded.config, [[7, 8, 9]])
    model = Qwen2ForCausalLM(loaded.config)
    logits = [np.asarray(jax.jit(model.apply)({"params": tree, "rope": rope_variables(
        loaded.config)}, ids, pos, kv, md)[0]) for tree in (dense, quantized)]
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=1e-4)


def test_quantization_arg_and_its_errors(tiny_gguf, tiny_models):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "gguf"])) \
        .quantization == "gguf"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "awq"])
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="awq")
    with pytest.raises(ModelLoadError, match="needs a .gguf model"):
        load_model(tiny_models["tied"][0], progress=False, quantization="gguf")
    with pytest.raises(ModelLoadError, match="float32"):
        load_model(tiny_gguf[0], dtype=jnp.bfloat16, progress=False, quantization="gguf")
    assert EngineArgs.from_cli_args(parser.parse_args(["--gguf-compact"])).gguf_compact is True
    for kw, platform, has in (({"quantization": "none"}, "cpu", "'none' on cpu"),
                              ({"dtype": "bfloat16"}, "cpu", "'none' on cpu"),
                              ({"quantization": "gguf"}, "gpu", "'gguf' on gpu"),
                              ({"quantization": "gguf", "kernel_backend": "interpret"}, "cpu",
                               "'gguf' on cpu with 'interpret'")):
        with pytest.raises(ValueError, match=rf"gguf_compact .* needs quantization 'gguf' on CPU "
                                             rf"with the reference kernel backend, this engine "
                                             rf"has quantization {has}"):
            EngineArgs(model=str(tiny_gguf[0]), gguf_compact=True, **kw) \
                .create_engine_config(platform)
    assert EngineArgs(model=str(tiny_gguf[0]), quantization="gguf", gguf_compact=True) \
        .create_engine_config("cpu").gguf_compact


def test_default_quantization_is_gguf_for_gguf_models_on_cpu(tiny_gguf, tiny_models):
    """Not given: "gguf" for a .gguf model on CPU (float32, reference backend, one device, the
    kernel built), "none" for a checkpoint directory, a bfloat16 run, or when asked."""
    from jaxllm.model_executor.layers.quantization.gguf import use_cpu_kernel
    from jaxllm.model_executor.model_loader.loader import is_gguf_model

    path = tiny_gguf[0]
    assert is_gguf_model(path) and not is_gguf_model(tiny_models["tied"][0])
    assert not is_gguf_model(path.parent / "missing.gguf")

    def resolved(model, platform="cpu", **kw):
        return EngineArgs(model=str(model), **kw).create_engine_config(platform).quantization

    assert resolved(path) == ("gguf" if use_cpu_kernel() else "none")
    assert resolved(path, quantization="none") == "none"
    assert resolved(path, quantization="gguf") == "gguf"
    assert resolved(path, dtype="bfloat16") == "none"
    assert resolved(path, tensor_parallel_size=2) == "none"
    assert resolved(path, kernel_backend="interpret") == "none"
    assert resolved(path, platform="gpu") == "none"  # opt-in on a GPU
    assert resolved(tiny_models["tied"][0]) == "none"
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--quantization", "none"])) \
        .quantization == "none"
    llm = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, show_progress=False, multiprocess_mode=False)
    want = "gguf" if use_cpu_kernel() else "none"
    assert llm.llm_engine.describe()["quantization"] == want
    runner = runner_of(llm)  # in process: its weight trees
    assert bool(_quantized((runner.params, runner.gemv_params))) == (want == "gguf")


def test_unsupported_type_in_a_gguf_is_named(tmp_path):
    path = tmp_path / "q4_1.gguf"
    write_tiny_gguf(path, formats={"blk.1.ffn_up.weight": "Q4_1"})
    load_model(path, progress=False)  # dequantizing it is fine
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight: GGUF type Q4_1.*'none'"):
        load_model(path, progress=False, quantization="gguf")
    load_model(path, progress=False, quantization="none")
    # The automatic default does not pick "gguf" for a file it cannot keep quantized.
    from jaxllm.model_executor.model_loader.loader import gguf_keeps_quantized
    assert not gguf_keeps_quantized(path)
    llm = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, show_progress=False)
    assert llm.llm_engine.describe()["quantization"] == "none"
