"""OLMo 2 against Hugging Face transformers on tiny random checkpoints (float32, hidden 64, 4
query heads of 16 dims; tests/utils.py TINY_FAMILIES): no pre-norms, each sublayer's output
normed before it joins the residual, and RMSNorms over the whole q and k projections before
RoPE. One checkpoint with 2 KV heads, one with 4 (multi-head, as OLMo 2's own) and biases on q,
k, v and o_proj (added before the q/k norms) and YaRN RoPE. Each feature is first shown to
change transformers' logits; then logits on the reference, interpret-mode Pallas and CPU
attention kernels, greedy tokens through LLM with chunked prefill and prefix-cache hits and
with n-gram speculation, tensor parallelism 2 and 4 (the q/k norms' statistics spanning the
devices, KV heads replicated at 4) against one device and lowered for CUDA, float32 and Q8_0
GGUF files as llama.cpp converts them (Q8_0 kept quantized), configs and refusals.
"""

from __future__ import annotations

import functools
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
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from tests.gguf_models import write_gguf_from_hf, write_skeleton_gguf
from tests.model_inputs import prefill_logits
from tests.utils import (
    YARN_ROPE,
    hf_greedy_tokens,
    hf_prompt_logits,
    make_llm,
    random_prompts,
    scheduler_state,
    tiny_checkpoints,
)

# Weights five times transformers' initialization: logits of a few units, so that what each
# feature changes stands far above the tolerance.
FAMILIES = {
    "olmo2": dict(arch="olmo2", tied=False, seed=51, initializer_range=0.1),
    "olmo2_mha_bias": dict(arch="olmo2", tied=False, seed=53, initializer_range=0.1,
                           num_key_value_heads=4, attention_bias=True, rope_scaling=YARN_ROPE,
                           max_position_embeddings=256),
}
HEAD_DIM = 16
LOGIT_LENS = [1, 9, 90]
MAX_NEW = 12
BACKENDS = ["reference", "interpret", "cpu"]
TP_CHILD = Path(__file__).parents[1] / "distributed" / "tp_child.py"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def loaded(family):
    return functools.cache(lambda name: load_model(family(name)[0], progress=False))


@pytest.fixture(scope="module")
def hf_logits(family):
    @functools.cache
    def run(name: str, prompt: tuple[int, ...]) -> np.ndarray:
        return hf_prompt_logits(family(name)[1], list(prompt))

    return run


def _logits(loaded, prompts, backend: str) -> list[np.ndarray]:
    if backend == "cpu":
        if not cpu_attention.available():
            pytest.skip("our CPU attention kernel is not built here (no compiler)")
        return prefill_logits(loaded, prompts, kernel_backend="reference", attention_impl="cpu")
    return prefill_logits(loaded, prompts, kernel_backend=backend)


class _PerHeadNorm(torch.nn.Module):
    """An OLMo 2 q or k norm (same weight and eps) taken over each head instead of the whole
    projection, as Qwen3's are."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(*x.shape[:-1], -1, HEAD_DIM).float()
        heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True)
                                    + self.norm.variance_epsilon)
        return self.norm.weight * heads.reshape(x.shape)


class _NormFirst(torch.nn.Module):
    """A sublayer with its OLMo 2 norm moved before it (Llama's pre-norm order)."""

    def __init__(self, norm: torch.nn.Module, sublayer: torch.nn.Module):
        super().__init__()
        self.norm, self.sublayer = norm, sublayer

    def forward(self, *args, **kwargs):
        # transformers' layer hands the attention its input by keyword, the MLP by position.
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self.norm(kwargs["hidden_states"])
        else:
            args = (self.norm(args[0]), *args[1:])
        return self.sublayer(*args, **kwargs)


def _hf_logits_swapped(hf, prompt, swaps) -> np.ndarray:
    """HF's logits with some modules replaced for the call: (owner, attribute, replacement)."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, new in swaps:
        setattr(owner, name, new)
    try:
        return hf_prompt_logits(hf, prompt)
    finally:
        for owner, name, old in saved:
            setattr(owner, name, old)


# --- the checkpoints are what they claim ---------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_checkpoints_exercise_their_features(family, hf_logits, name):
    """The oracle's side: HF's logits move by far more than the tolerance when either post norm
    is dropped or moved before its sublayer, or when the q or k norm is taken per head; the
    norms' weights are away from one and the biases away from zero."""
    _, hf = family(name)
    prompt = random_prompts(1, [40])[0]
    base = hf_logits(name, tuple(prompt))
    assert 1.0 < np.abs(base).max() < 20.0
    layers = hf.model.layers
    identity = torch.nn.Identity()
    cases = {
        "no post-attention norm": [(x, "post_attention_layernorm", identity) for x in layers],
        "no post-feedforward norm": [(x, "post_feedforward_layernorm", identity)
                                     for x in layers],
        "attention norm first": [(x, "self_attn", _NormFirst(x.post_attention_layernorm,
                                                             x.self_attn)) for x in layers]
        + [(x, "post_attention_layernorm", identity) for x in layers],
        "mlp norm first": [(x, "mlp", _NormFirst(x.post_feedforward_layernorm, x.mlp))
                           for x in layers]
        + [(x, "post_feedforward_layernorm", identity) for x in layers],
        "q norm per head": [(x.self_attn, "q_norm", _PerHeadNorm(x.self_attn.q_norm))
                            for x in layers],
        "k norm per head": [(x.self_attn, "k_norm", _PerHeadNorm(x.self_attn.k_norm))
                            for x in layers],
    }
    for case, swaps in cases.items():
        assert np.abs(_hf_logits_swapped(hf, prompt, swaps) - base).max() > 1e-2, case
    attn = layers[0].self_attn
    cfg = hf.config
    assert attn.q_norm.weight.shape == (cfg.num_attention_heads * HEAD_DIM,)
    assert attn.k_norm.weight.shape == (cfg.num_key_value_heads * HEAD_DIM,)
    for pname, param in hf.named_parameters():
        if pname.endswith("norm.weight"):
            assert (param - 1).abs().mean() > 0.1, pname
    norms = {n.rsplit(".", 2)[-2] for n, _ in hf.named_parameters() if "layers.0." in n
             and n.endswith("norm.weight")}
    assert norms == {"post_attention_layernorm", "post_feedforward_layernorm", "q_norm",
                     "k_norm"}
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    if name == "olmo2_mha_bias":
        assert all(p.bias.abs().mean() > 0.1 for p in projections)
    else:
        assert all(p.bias is None for p in projections)


def test_configs_read_the_olmo2_fields(loaded):
    gqa, mha = loaded("olmo2").config, loaded("olmo2_mha_bias").config
    for cfg in (gqa, mha):
        assert cfg.architecture == "Olmo2ForCausalLM"
        assert (cfg.rms_norm_eps, cfg.head_dim, cfg.tie_word_embeddings) == (1e-5, 16, False)
        assert cfg.sliding_window is None and cfg.eos_token_ids == (2,)
    assert (gqa.num_key_value_heads, gqa.attention_bias, gqa.o_proj_bias, gqa.rope_scaling) == \
        (2, False, False, None)
    assert (mha.num_key_value_heads, mha.attention_bias, mha.o_proj_bias) == (4, True, True)
    assert mha.rope_scaling is not None and (mha.rope_scaling.rope_type, mha.rope_scaling.factor,
                                             mha.rope_scaling.original_max_position_embeddings) \
        == ("yarn", 4.0, 64)


def test_defaults_are_transformers_olmo2_config():
    """A config.json that leaves every optional field out reads as Olmo2Config fills it in;
    `use_sliding_window` (which OLMo 2's attention never reads) gives no window."""
    import transformers

    raw = {"model_type": "olmo2", "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    hf = transformers.Olmo2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.architecture == "Olmo2ForCausalLM"
    assert (cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.eos_token_id, cfg.bos_token_id,
            cfg.rope_theta, cfg.attention_bias, cfg.tie_word_embeddings,
            cfg.num_key_value_heads) == (
        hf.max_position_embeddings, hf.rms_norm_eps, hf.eos_token_id, hf.bos_token_id,
        hf.rope_parameters["rope_theta"], hf.attention_bias, hf.tie_word_embeddings,
        hf.num_key_value_heads)
    windowed = ModelConfig.from_hf_config({**raw, "use_sliding_window": True,
                                           "sliding_window": 8, "max_window_layers": 0})
    assert windowed.sliding_window is None


# --- logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_hf(loaded, hf_logits, name, backend):
    prompts = random_prompts(2, LOGIT_LENS)
    for prompt, got in zip(prompts, _logits(loaded(name), prompts, backend), strict=True):
        np.testing.assert_allclose(got, hf_logits(name, tuple(prompt)), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {backend}, {len(prompt)} tokens")


# --- greedy tokens through the engine: chunked prefill, prefix hits -----------------------------


def test_greedy_generate_with_chunked_prefill_and_prefix_hits_matches_hf(family):
    """One engine (our CPU kernel on CPU): 16-token steps chunk every prefill; the second batch
    shares 48 and 64 tokens with the first prompt, which the prefix cache serves."""
    path, hf = family("olmo2")
    llm = make_llm(path, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
                   max_num_seqs=4, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    base = random_prompts(3, [70])[0]
    extra = random_prompts(4, [5, 12, 20])
    batch = [base[:48] + extra[0], base[:64] + extra[1], extra[2]]
    first = llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    llm.shutdown()
    assert outs[0].num_cached_tokens >= 48 and outs[1].num_cached_tokens >= 64
    for prompt, out in zip([base, *batch], first + outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW), \
            f"prompt of {len(prompt)} tokens"


def test_greedy_with_ngram_speculation_matches_hf(family):
    """Prompt-lookup drafts, verified by the target in one step each, leave the greedy tokens
    HF's (prompts that repeat themselves, so drafts are proposed)."""
    path, hf = family("olmo2")
    llm = make_llm(path, dtype="float32", max_model_len=128, max_num_seqs=4,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    prompts = [p * 4 for p in random_prompts(6, [6, 9])]
    before = scheduler_state(llm)["num_spec_drafts"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    drafts = scheduler_state(llm)["num_spec_drafts"] - before
    llm.shutdown()
    assert drafts > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW), \
            f"prompt of {len(prompt)} tokens"


# --- tensor parallelism --------------------------------------------------------------------------


def test_tensor_parallel_matches_one_device(family, tmp_path):
    """TP 2 and 4 on virtual CPU devices (a child process: the device count is fixed when JAX
    starts), 2 KV heads: at TP 2 each device holds one KV head, at TP 4 each KV head is on two
    devices; the q and k norms' statistics span every device's heads (their weights split by
    head, the k norm's repeated with its heads). Every step's logits and the greedy tokens as
    on one device."""
    path, _ = family("olmo2")
    out = tmp_path / "tp.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(TP_CHILD.parents[2]),
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run([sys.executable, str(TP_CHILD), str(path), str(out), "1,2,4",
                           '{"max_num_seqs": 2, "max_num_batched_tokens": 16}'],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = dict(np.load(out))
    for tp in (2, 4):
        np.testing.assert_array_equal(r[f"tp{tp}_tokens"], r["tp1_tokens"])
        np.testing.assert_allclose(r[f"tp{tp}_logits"], r["tp1_logits"], rtol=0, atol=1e-5,
                                   err_msg=f"TP {tp}")


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_tensor_parallel_step_lowers_for_cuda_with_the_norms_statistics_all_reduced(kv_heads):
    """TP 2 lowered for CUDA on an abstract mesh (no devices), the Pallas kernels per device,
    bfloat16: per layer the o_proj and down_proj all-reduces plus one float32 value per token
    for the q norm and one for the k norm (KV heads split, or replicated with one KV head)."""
    from jaxllm.distributed.check_tp_lowering import collectives, lower_sharded_step

    cfg = ModelConfig.from_hf_config(dict(
        architectures=["Olmo2ForCausalLM"], vocab_size=512, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads))
    tokens, layers = 64, cfg.num_hidden_layers
    text = lower_sharded_step(cfg, 2, tokens, decode=False, max_model_len=512)
    assert "__gpu$xla.gpu.triton" in text
    c = collectives(text)
    assert c.all_reduces == 4 * layers + 1
    assert c.all_reduce_bytes == (2 * layers + 1) * tokens * cfg.hidden_size * 2 \
        + 2 * layers * tokens * 4


# --- GGUF files, converted as llama.cpp converts them --------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float32_gguf_matches_hf(family, loaded, hf_logits, tmp_path, name):
    """llama.cpp's `olmo2` layout: q/k rows as Hugging Face's (its RoPE rotates halves), the
    norms as attn_q_norm, attn_k_norm, post_attention_norm, post_ffw_norm. The config read from
    the file is the checkpoint's, the logits HF's."""
    _, hf = family(name)
    path = tmp_path / f"{name}.gguf"
    write_gguf_from_hf(path, hf)
    got = load_model(path, progress=False)
    want = loaded(name).config
    for field in ("architecture", "num_key_value_heads", "head_dim", "attention_bias",
                  "o_proj_bias", "rope_scaling", "sliding_window", "tie_word_embeddings"):
        assert getattr(got.config, field) == getattr(want, field), field
    assert got.config.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-7)
    prompts = random_prompts(2, LOGIT_LENS)
    for prompt, g in zip(prompts, _logits(got, prompts, "reference"), strict=True):
        np.testing.assert_allclose(g, hf_logits(name, tuple(prompt)), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {len(prompt)} tokens")


def test_q8_0_gguf_kept_quantized_matches_hf_on_the_files_values(family, tmp_path):
    """A Q8_0 file with quantization="gguf" (on CPU the engine runs our fused dequant matmul
    kernel over its blocks) against transformers holding the weights gguf dequantizes from the
    file (transformers reads no `olmo2` GGUF itself): logits within 1e-3, greedy tokens
    equal."""
    import copy

    import gguf

    _, hf = family("olmo2")
    path = tmp_path / "olmo2-q8_0.gguf"
    write_gguf_from_hf(path, hf, "Q8_0")
    oracle = copy.deepcopy(hf)
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for param in oracle.parameters():
            if param.ndim == 2:  # every matrix is stored quantized, the vectors as float32
                blocks = gguf.quants.quantize(param.numpy(), q8_0)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, q8_0)))
    assert not torch.equal(oracle.lm_head.weight, hf.lm_head.weight)
    prompts = random_prompts(7, [9, 70])
    got = _logits(load_model(path, progress=False, quantization="gguf"), prompts, "reference")
    for prompt, g in zip(prompts, got, strict=True):
        np.testing.assert_allclose(g, hf_prompt_logits(oracle, prompt), atol=1e-3, rtol=0)
    llm = make_llm(path, quantization="gguf", max_model_len=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    llm.shutdown()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(oracle, prompt, MAX_NEW), \
            f"prompt of {len(prompt)} tokens"


def test_olmo2_gguf_with_a_window_is_refused_by_name(tmp_path):
    """llama.cpp writes OLMo 3 as `olmo2` with a sliding window (three layers in four)."""
    path = tmp_path / "olmo3.gguf"
    write_skeleton_gguf(path, "olmo2", {"olmo2.attention.sliding_window": 4096})
    with pytest.raises(ModelLoadError, match="'olmo2' with a sliding window .*OLMo 3"):
        load_model(path, progress=False)
