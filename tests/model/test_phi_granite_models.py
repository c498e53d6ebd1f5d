"""Phi-3 and Granite against Hugging Face transformers on tiny random checkpoints (float32).

Phi-3: q/k/v and gate/up fused on disk, a 40-token sliding window on every layer (prompts run
past it); a tied Phi-4-mini-like one with RoPE on 12 of each head's 16 dims
(`partial_rotary_factor` 0.75) and longrope scaling "trained" on 32 positions, run within that
length (HF's forward over the whole prompt) and past it step by step (HF with its KV cache, each
token past the original length in a forward of its own, which is the per-position rule jaxllm
keeps). Granite: embedding, attention, residual and logits multipliers, biases on q, k, v and
o_proj. Logits on the reference, interpret-mode Pallas and CPU attention kernels; greedy tokens
through LLM with chunked prefill and prefix-cache hits; config defaults and refusals.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers import cpu_attention
from jaxllm.model_executor.model_loader.loader import load_model
from tests.model_inputs import prefill_logits
from tests.utils import (
    hf_cached_logits_and_greedy,
    hf_greedy_tokens,
    hf_prompt_logits,
    make_llm,
    random_prompts,
    tiny_checkpoints,
)

WINDOW = 40
ORIGINAL = 32  # longrope's original_max_position_embeddings
LONGROPE = {"rope_type": "longrope", "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 14.0]}
GRANITE_MULTIPLIERS = dict(embedding_multiplier=6.0, attention_multiplier=3.0,
                           residual_multiplier=0.4, logits_scaling=2.5)
FAMILIES = {
    "phi3": dict(arch="phi3", tied=False, seed=41, sliding_window=WINDOW),
    "phi3_longrope": dict(arch="phi3", tied=True, seed=42, max_position_embeddings=256,
                          original_max_position_embeddings=ORIGINAL, rope_scaling=LONGROPE),
    "granite": dict(arch="granite", tied=False, seed=43, attention_bias=True,
                    **GRANITE_MULTIPLIERS),
}
ARCHITECTURE = {"phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM"}
# Whole-prompt logits: the windowed and Granite checkpoints past the window, longrope's within
# its original length (past it, HF's whole-prompt forward takes the long factors for every
# position; see the step-by-step test).
LOGIT_LENS = {"phi3": [1, 9, 90], "phi3_longrope": [1, 9, ORIGINAL], "granite": [1, 9, 90]}
MAX_NEW = 16
BACKENDS = ["reference", "interpret", "cpu"]
TP_CHILD = Path(__file__).parents[1] / "distributed" / "tp_child.py"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def loaded(family):
    return functools.cache(lambda name: load_model(family(name)[0], progress=False))


def _logits(loaded, prompts, backend: str) -> list[np.ndarray]:
    if backend == "cpu":
        if not cpu_attention.available():
            pytest.skip("our CPU attention kernel is not built here (no compiler)")
        return prefill_logits(loaded, prompts, kernel_backend="reference", attention_impl="cpu")
    return prefill_logits(loaded, prompts, kernel_backend=backend)


def _hf_logits_without(hf, prompt, **attrs) -> np.ndarray:
    """HF's logits with some of its modules' attributes set aside (restored after)."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in attrs.values()]
    for obj, name, value in attrs.values():
        setattr(obj, name, value)
    try:
        return hf_prompt_logits(hf, prompt)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# --- the checkpoints are what they claim ---------------------------------------------------------


def test_tiny_checkpoints_exercise_their_features(family):
    """Fused tensors on disk, a window that changes what HF computes, RoPE on part of each
    head, longrope short and long tables and attention factor, Granite's multipliers each
    changing HF's logits."""
    from safetensors import safe_open

    path, phi3 = family("phi3")
    with safe_open(path / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    assert phi3.config.sliding_window == WINDOW
    prompt = random_prompts(4, [90])[0]
    unwindowed = _hf_logits_without(phi3, prompt, w=(phi3.config, "sliding_window", None))
    assert np.abs(unwindowed - hf_prompt_logits(phi3, prompt))[WINDOW:].max() > 1e-3

    path, longrope = family("phi3_longrope")
    rope = longrope.model.rotary_emb
    assert rope.inv_freq.numel() == 6 < longrope.config.hidden_size // 4 // 2  # partial
    assert rope.attention_scaling > 1.1
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_type"] == "longrope" and cfg["tie_word_embeddings"]
    # A forward past the original length takes the long factors for every position: other
    # logits than the short factors give the same positions.
    prompt = random_prompts(5, [ORIGINAL + 1])[0]
    full = hf_prompt_logits(longrope, prompt)
    stepped, _ = hf_cached_logits_and_greedy(longrope, prompt, 0, ORIGINAL)
    assert np.abs(full[:ORIGINAL] - stepped[:ORIGINAL]).max() > 1e-3

    _, granite = family("granite")
    layers = granite.model.layers
    prompt = random_prompts(6, [20])[0]
    want = hf_prompt_logits(granite, prompt)
    cases = {
        "embedding": dict(e=(granite.model, "embedding_multiplier", 1.0)),
        "attention": {f"a{i}": (layer.self_attn, "scaling", 1.0) for i, layer in
                      enumerate(layers)},
        "residual": {f"r{i}": (layer, "residual_multiplier", 1.0) for i, layer in
                     enumerate(layers)},
        "logits": dict(s=(granite.config, "logits_scaling", 1.0)),
    }
    for name, attrs in cases.items():
        assert np.abs(_hf_logits_without(granite, prompt, **attrs) - want).max() > 1e-3, name
    attn = layers[0].self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))


def test_configs_read_the_families_fields(loaded):
    phi3 = loaded("phi3").config
    assert (phi3.architecture, phi3.sliding_window, phi3.rotary_dim) == (
        "Phi3ForCausalLM", WINDOW, 16)
    assert [phi3.layer_sliding_window(i) for i in range(2)] == [WINDOW, WINDOW]
    assert not phi3.attention_bias and not phi3.o_proj_bias
    longrope = loaded("phi3_longrope").config
    s = longrope.rope_scaling
    assert s is not None and s.rope_type == "longrope"
    assert (longrope.rotary_dim, s.original_max_position_embeddings, s.factor) == (12, 32, 8.0)
    assert s.short_factor == tuple(LONGROPE["short_factor"])
    assert longrope.max_context_len == 256
    granite = loaded("granite").config
    assert (granite.embedding_multiplier, granite.attention_scale, granite.residual_multiplier,
            granite.logits_scaling) == (6.0, 3.0, 0.4, 2.5)
    assert granite.attention_bias and granite.o_proj_bias


# --- logits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_hf(family, loaded, name, backend):
    _, hf = family(name)
    assert loaded(name).config.architecture == ARCHITECTURE[FAMILIES[name]["arch"]]
    prompts = random_prompts(1, LOGIT_LENS[name])
    for prompt, got in zip(prompts, _logits(loaded(name), prompts, backend), strict=True):
        np.testing.assert_allclose(got, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {backend}, {len(prompt)} tokens")


@pytest.mark.parametrize("backend", BACKENDS)
def test_longrope_past_the_original_length_is_hf_decoding_step_by_step(family, loaded,
                                                                       backend):
    """A prompt of 80 positions in one prefill: those below 32 rotate with the short factors,
    the others with the long ones, as HF computes them when each position past 32 is its own
    forward over the cache."""
    _, hf = family("phi3_longrope")
    prompt = random_prompts(2, [80])[0]
    want, _ = hf_cached_logits_and_greedy(hf, prompt, 0, ORIGINAL)
    got = _logits(loaded("phi3_longrope"), [prompt], backend)[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=backend)


# --- greedy tokens through the engine: chunked prefill, prefix hits -----------------------------


def _hf_tokens(name: str, hf, prompt: list[int]) -> list[int]:
    if name == "phi3_longrope":
        return hf_cached_logits_and_greedy(hf, prompt, MAX_NEW, min(len(prompt), ORIGINAL))[1]
    with torch.no_grad():
        return hf_greedy_tokens(hf, prompt, MAX_NEW)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generate_with_chunked_prefill_and_prefix_hits_matches_hf(family, name):
    """16-token steps chunk every prefill; the second batch shares 48 and 64 tokens with the
    first prompt, which the prefix cache serves. The prompts cross the window (Phi-3) and, in
    prefill or decode, longrope's original length."""
    path, hf = family(name)
    llm = make_llm(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                   max_num_seqs=4, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    base = random_prompts(3, [70])[0]
    extra = random_prompts(4, [5, 12, 20])
    batch = [base[:48] + extra[0], base[:64] + extra[1], extra[2]]
    first = llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    for prompt, out in zip([base, *batch], first + outs, strict=True):
        assert out.outputs[0].token_ids == _hf_tokens(name, hf, prompt), \
            f"{name}, prompt of {len(prompt)} tokens"
    assert outs[0].num_cached_tokens >= 48 and outs[1].num_cached_tokens >= 64
    llm.shutdown()


@pytest.mark.parametrize("name", ["phi3_longrope", "granite"])
def test_tensor_parallel_2_matches_one_device(family, tmp_path, name):
    """TP 2 on two virtual CPU devices (a child process: the device count is fixed when JAX
    starts): Phi-3's fused q/k/v split per device after the partial-rotary reordering within
    each head, Granite's multipliers on every shard; every step's logits and the greedy tokens
    as on one device (a 30-token prompt decodes past longrope's original length)."""
    path, _ = family(name)
    out = tmp_path / "tp.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(TP_CHILD.parents[2]),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(TP_CHILD), str(path), str(out), "1,2",
                           '{"max_num_seqs": 2, "max_num_batched_tokens": 16}'],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = dict(np.load(out))
    np.testing.assert_array_equal(r["tp2_tokens"], r["tp1_tokens"])
    np.testing.assert_allclose(r["tp2_logits"], r["tp1_logits"], rtol=0, atol=1e-5)


# --- GGUF files, converted as llama.cpp converts them ------------------------------------------


@pytest.fixture(scope="module")
def gguf_file(family, tmp_path_factory):
    from tests.gguf_models import write_gguf_from_hf

    @functools.cache
    def write(name: str, ftype: str):
        path = tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}-{ftype}.gguf"
        write_gguf_from_hf(path, family(name)[1], ftype)
        return path

    return write


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float32_gguf_matches_hf(family, loaded, gguf_file, name):
    """llama.cpp's layout: Phi-3's fused `attn_qkv` and `ffn_up` (gate and up), its rotary
    dims, window and longrope factors as tensors; Granite's q/k rows interleaved and its
    multipliers as metadata. The config read from the file is the checkpoint's, the logits
    HF's (longrope past its original length: HF step by step)."""
    _, hf = family(name)
    got = load_model(gguf_file(name, "F32"), progress=False)
    want = loaded(name).config
    for field in ("architecture", "rotary_dim", "sliding_window", "rope_scaling",
                  "embedding_multiplier", "residual_multiplier", "attention_scale",
                  "logits_scaling", "tie_word_embeddings"):
        a, b = getattr(got.config, field), getattr(want, field)
        if field == "rope_scaling" and a is not None:
            # llama.cpp stores the attention factor the HF config leaves to its default, and
            # the factors in float32.
            assert b is not None and abs(a.attention_factor - np.sqrt(1 + np.log(8) / np.log(
                ORIGINAL))) < 1e-6
            np.testing.assert_allclose(a.short_factor + a.long_factor,
                                       b.short_factor + b.long_factor, rtol=1e-7)
            a = dataclasses.replace(a, attention_factor=None, short_factor=b.short_factor,
                                    long_factor=b.long_factor)
        # GGUF metadata holds float32 numbers.
        assert a == (pytest.approx(b, rel=1e-7) if isinstance(b, float) else b), field
    prompts = random_prompts(1, LOGIT_LENS[name])
    for prompt, g in zip(prompts, _logits(got, prompts, "reference"), strict=True):
        np.testing.assert_allclose(g, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {len(prompt)} tokens")
    if name == "phi3_longrope":
        prompt = random_prompts(2, [80])[0]
        want_logits, _ = hf_cached_logits_and_greedy(hf, prompt, 0, ORIGINAL)
        np.testing.assert_allclose(_logits(got, [prompt], "reference")[0], want_logits,
                                   atol=1e-4, rtol=0)


def test_q8_0_gguf_kept_quantized_is_its_dequantized_model(gguf_file):
    """Phi-3's fused q/k/v blocks kept quantized (run by the interpret-mode Pallas dequant
    matmul), their rows reordered for partial rotary as whole blocks: the logits of the file's
    dequantized weights (a float32 load, proven against HF above)."""
    from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight

    path = gguf_file("phi3_longrope", "Q8_0")
    quantized = load_model(path, progress=False, quantization="gguf",
                           kernel_backend="interpret")
    assert isinstance(quantized.params["layers_0"]["self_attn"]["qkv_proj"]["weight"],
                      GGUFWeight)
    dense = load_model(path, progress=False)
    prompts = random_prompts(3, [9, 60])
    for a, b in zip(_logits(quantized, prompts, "interpret"), _logits(dense, prompts, "reference"),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


# --- defaults and refusals ----------------------------------------------------------------------


def _config(arch: str, **changes) -> dict:
    cfg = dict(architectures=[arch], vocab_size=512, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg.update(changes)
    return cfg


def test_defaults_are_transformers_config_classes():
    phi3 = ModelConfig.from_hf_config(_config("Phi3ForCausalLM", rope_scaling={
        "type": "su", **{k: LONGROPE[k] for k in ("short_factor", "long_factor")}},
        partial_rotary_factor=0.75, max_position_embeddings=131072))
    assert phi3.rope_scaling is not None and phi3.rope_scaling.rope_type == "longrope"
    assert (phi3.rms_norm_eps, phi3.rope_scaling.original_max_position_embeddings,
            phi3.sliding_window) == (1e-5, 4096, None)
    assert ModelConfig.from_hf_config(_config("Phi3ForCausalLM")).max_position_embeddings == 4096
    granite = ModelConfig.from_hf_config(_config("GraniteForCausalLM"))
    assert (granite.attention_scale, granite.embedding_multiplier, granite.logits_scaling,
            granite.max_position_embeddings) == (1.0, 1.0, 1.0, 2048)
    assert ModelConfig.from_hf_config(_config("LlamaForCausalLM")).attention_scale == 0.25


@pytest.mark.parametrize("arch, changes, match", [
    ("Phi3ForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope type 'linear' is not Phi-3's"),
    ("LlamaForCausalLM", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.4375), "7 rotary dims"),
    ("Phi3ForCausalLM", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 7}), "long_factor must list"),
    ("Phi3ForCausalLM", dict(rope_scaling={"rope_type": "longrope", "long_factor": [1.0] * 8}),
     "short_factor must be a list"),
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                            "short_factor": [1.0] * 8}), "belong to rope type"),
    ("GraniteForCausalLM", dict(logits_scaling=0), "logits_scaling"),
    ("GraniteForCausalLM", dict(residual_multiplier="x"), "residual_multiplier"),
])
def test_unsupported_options_are_refused_by_name(arch, changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_config(arch, **changes))
