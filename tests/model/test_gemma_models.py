"""The Gemma families against Hugging Face transformers on tiny random checkpoints (float32,
hidden 64, head_dim 32; tests/utils.py TINY_FAMILIES): Gemma (norms scaling by 1 + weight,
embeddings scaled by sqrt(hidden), GeGLU), Gemma 2 (four norms per layer, q.k scaled by
query_pre_attn_scalar, attention and final logit soft caps, a window on every other layer) and
Gemma 3's text model (per-head q/k norms, two sliding layers with their own RoPE base before a
global one whose RoPE is linearly scaled). Logits with the reference and
interpret-mode Pallas kernels; greedy tokens and logprobs through LLM (our CPU kernel on CPU)
with chunked prefill and prefix-cache hits, prompts running far past the window; what the
configs read, and what is refused by name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.registry import abstract_params, get_model_class
from tests.model_inputs import prefill_logits
from tests.utils import (
    hf_greedy_tokens,
    hf_prompt_logits,
    make_llm,
    random_prompts,
    tiny_checkpoints,
)

FAMILIES = {
    "gemma": dict(arch="gemma", tied=True, seed=41),
    "gemma2": dict(arch="gemma2", tied=True, seed=42),
    "gemma3": dict(arch="gemma3", tied=True, seed=43),
}
ARCHITECTURE = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3": "Gemma3ForCausalLM"}
WINDOW = 20  # Gemma 2's and 3's, TINY_FAMILIES
LOGIT_LENS = [1, 9, 64, 120]
MAX_NEW = 12


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def loaded(family):
    return functools.cache(lambda name: load_model(family(name)[0], progress=False))


@pytest.fixture(scope="module")
def hf_greedy(family):
    @functools.cache
    def run(name: str, prompt: tuple[int, ...]) -> list[int]:
        return hf_greedy_tokens(family(name)[1], list(prompt), MAX_NEW)

    return run


def _hf_logits_with(hf, prompt, **config):
    """HF's logits of `prompt` with config attributes (and the attention layers' copies of
    them) changed for the call."""
    saved = {k: getattr(hf.config, k) for k in config if hasattr(hf.config, k)}
    layers = [layer.self_attn for layer in hf.model.layers]
    saved_attn = [{k: getattr(a, k) for k in config if hasattr(a, k)} for a in layers]
    try:
        for k, v in config.items():
            if k in saved:
                setattr(hf.config, k, v)
            for a in layers:
                if hasattr(a, k):
                    setattr(a, k, v)
        return hf_prompt_logits(hf, prompt)
    finally:
        for k, v in saved.items():
            setattr(hf.config, k, v)
        for a, kept in zip(layers, saved_attn, strict=True):
            for k, v in kept.items():
                setattr(a, k, v)


# --- the checkpoints are what they claim ---------------------------------------------------------


def test_tiny_gemma_checkpoints_exercise_their_features(family):
    """The oracle's side: each feature changes HF's logits at the prompt lengths used here by
    far more than the tolerance: the soft caps, the window (on the sliding layers only), the
    sliding layers' RoPE base; norm weights (offsets from one) far from zero; head_dim and
    query_pre_attn_scalar unlike hidden / heads."""
    prompt = random_prompts(1, [150])[0]
    _, gemma2 = family("gemma2")
    base = hf_prompt_logits(gemma2, prompt)
    assert gemma2.config._attn_implementation == "eager"  # the one that soft-caps
    assert [a.self_attn.sliding_window for a in gemma2.model.layers] == [WINDOW, None]
    assert np.abs(_hf_logits_with(gemma2, prompt, attn_logit_softcapping=None) - base).max() \
        > 1e-2
    assert np.abs(_hf_logits_with(gemma2, prompt, final_logit_softcapping=None) - base).max() \
        > 1e-1
    assert np.abs(base).max() < 5.0
    windowless = _hf_logits_with(gemma2, prompt, sliding_window=10**6)
    assert np.abs(windowless - base)[:WINDOW].max() < 1e-5
    assert np.abs(windowless - base)[WINDOW:].max() > 1e-2
    assert gemma2.model.layers[0].self_attn.scaling == 24 ** -0.5
    assert np.abs(_hf_logits_with(gemma2, prompt, scaling=32 ** -0.5) - base).max() > 1e-2

    _, gemma3 = family("gemma3")
    base = hf_prompt_logits(gemma3, prompt)
    assert gemma3.config.layer_types == ["sliding_attention", "sliding_attention",
                                         "full_attention"]
    assert gemma3.config.attn_logit_softcapping is None
    assert gemma3.config.final_logit_softcapping is None
    windowless = _hf_logits_with(gemma3, prompt, sliding_window=10**6)
    assert np.abs(windowless - base)[WINDOW:].max() > 1e-2
    rope = gemma3.model.rotary_emb
    local, full = rope.sliding_attention_inv_freq, rope.full_attention_inv_freq
    exponents = torch.arange(0, 32, 2, dtype=torch.float64) / 32
    assert torch.allclose(local.double(), 1 / 100 ** exponents)
    assert torch.allclose(full.double(), 1 / (2 * 10000 ** exponents))
    for name in FAMILIES:
        hf = family(name)[1]
        assert hf.config.head_dim == 32 != hf.config.hidden_size // 4
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        for pname, param in hf.named_parameters():
            if pname.endswith("norm.weight"):
                assert param.abs().min() > 0.01 or param.abs().mean() > 0.5, pname
        norms = {n.rsplit(".", 2)[-2] for n, _ in hf.named_parameters() if "layers.0." in n
                 and n.endswith("norm.weight")}
        want = {"input_layernorm", "post_attention_layernorm"}
        if name != "gemma":
            want |= {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
        if name == "gemma3":
            want |= {"q_norm", "k_norm"}
        assert norms == want, name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_reads_the_gemma_fields(loaded, name):
    cfg = loaded(name).config
    assert cfg.architecture == ARCHITECTURE[name]
    assert (cfg.hidden_act, cfg.head_dim, cfg.tie_word_embeddings) == \
        ("gelu_pytorch_tanh", 32, True)
    windows = [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)]
    want = {"gemma": (None, None, None, [None, None], None),
            "gemma2": (24, 2.0, 5.0, [WINDOW, None], None),
            "gemma3": (24, None, None, [WINDOW, WINDOW, None], 100.0)}[name]
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping,
            cfg.final_logit_softcapping, windows, cfg.rope_local_theta) == want
    if name == "gemma3":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 2.0
        assert cfg.rope_theta == 10000.0 and cfg.rope_local_scaling is None
        assert cfg.max_context_len == cfg.max_position_embeddings  # already the stretched one


def test_norm_weights_are_one_plus_weight_in_float32(family):
    """Whatever the model's dtype: a bfloat16 model's norms scale by Hugging Face's
    1.0 + w.float(), not by that sum rounded to bfloat16."""
    from safetensors.numpy import load_file

    path, _ = family("gemma3")
    tensors = load_file(path / "model.safetensors")
    params = load_model(path, dtype=jnp.bfloat16, progress=False).params
    assert params["embed_tokens"].dtype == jnp.bfloat16
    for ours, theirs in ((params["norm"], "model.norm.weight"),
                         (params["layers_1"]["pre_feedforward_layernorm"],
                          "model.layers.1.pre_feedforward_layernorm.weight"),
                         (params["layers_1"]["self_attn"]["k_norm"],
                          "model.layers.1.self_attn.k_norm.weight")):
        assert ours["weight"].dtype == jnp.float32
        want = tensors[theirs].astype(np.float32) + np.float32(1.0)
        np.testing.assert_array_equal(np.asarray(ours["weight"]), want)
        assert not np.array_equal(want, want.astype(jnp.bfloat16).astype(np.float32))
    # The abstract tree the CUDA lowering checks compile against is the loaded one, dtypes too.
    abstract = abstract_params(get_model_class("Gemma3ForCausalLM")(
        ModelConfig.from_json_file(path / "config.json"), dtype=jnp.bfloat16))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), params)


# --- logits, both kernel backends --------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_hf(family, loaded, name):
    _, hf = family(name)
    prompts = random_prompts(1, LOGIT_LENS)
    want = [hf_prompt_logits(hf, p) for p in prompts]
    for backend in ("reference", "interpret"):
        got = prefill_logits(loaded(name), prompts, kernel_backend=backend)
        for prompt, g, w in zip(prompts, got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0,
                                       err_msg=f"{name}, {backend}, {len(prompt)} tokens")


# --- greedy tokens and logprobs through the engine ---------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_match_hf_with_chunked_prefill_and_prefix_hits(family, hf_greedy, name):
    """One engine (our CPU kernel on CPU): 16-token steps chunk every prefill; a 150-token
    prompt, then two sharing 96 and 64 of its tokens (prefix-cache hits) beside two others,
    every prompt past the window. The logprobs the engine reports for the sampled tokens and
    the prompt are log_softmax of HF's (soft-capped) logits."""
    path, hf = family(name)
    rng = np.random.default_rng(5)
    base = rng.integers(0, 512, 150).tolist()
    batch = [base[:96] + rng.integers(0, 512, 30).tolist(),
             base[:64] + rng.integers(0, 512, 7).tolist(),
             rng.integers(0, 512, 40).tolist(), rng.integers(0, 512, 3).tolist()]
    llm = make_llm(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16,
                   max_num_seqs=4, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    # Prompt logprobs for the first prompt only: a request asking for them reads nothing from
    # the prefix cache (as in vLLM).
    first = llm.generate([{"prompt_token_ids": base}],
                         dataclasses.replace(sp, prompt_logprobs=1), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    llm.shutdown()
    assert outs[0].num_cached_tokens >= 80 and outs[1].num_cached_tokens >= 48
    for prompt, out in zip([base] + batch, first + outs, strict=True):
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(name, tuple(prompt)), f"{name}, {len(prompt)} tokens"
        logits = torch.tensor(hf_prompt_logits(hf, prompt + tokens[:-1]), dtype=torch.float64)
        want = torch.log_softmax(logits, -1).numpy()
        seq = prompt + tokens
        got = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        np.testing.assert_allclose(got, [want[len(prompt) - 1 + j, t]
                                         for j, t in enumerate(tokens)], atol=1e-4, rtol=0)
        if out.prompt_logprobs is not None:
            got = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], prompt[1:],
                                                  strict=True)]
            np.testing.assert_allclose(got, [want[j, seq[j + 1]]
                                             for j in range(len(prompt) - 1)], atol=1e-4, rtol=0)
    assert first[0].prompt_logprobs is not None


def test_hybrid_kv_cache_runs_prompts_one_group_could_not_hold(family, hf_greedy):
    """Gemma 3 (two sliding layers, one global): its three layers make three KV cache groups
    of one layer each, so a block of the same byte budget holds one layer and the pool three
    times the blocks; a sliding group keeps only its window's. Prompts of 300, 200 and 150
    tokens, in a pool where one group (every layer in every block) holds 176 tokens, come out
    as HF's greedy tokens, the scheduler waiting or preempting as the pool fills, and every
    block back in the pool at the end. With the hybrid manager disabled the 300-token prompt
    is refused, naming the blocks it needs."""
    from jaxllm.model_executor.kv_cache_groups import kv_cache_groups
    from jaxllm.worker.model_runner import kv_block_bytes
    from tests.utils import assert_pool_free, scheduler_state

    path, _ = family("gemma3")
    cfg = load_model(path, progress=False).config
    groups = kv_cache_groups(cfg, 512)
    assert groups.windows == (None, WINDOW, WINDOW) and groups.num_slots == 1
    budget = 12 * kv_block_bytes(cfg, 16, np.float32)  # 12 blocks of all three layers
    args = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=16, max_num_seqs=3,
                kv_cache_memory_bytes=budget, num_kv_blocks=None)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in (300, 200, 150)]
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = make_llm(path, **args)
    try:
        state = scheduler_state(llm)
        assert state["num_usable_blocks"] == 36 - 1
        # A 512-token request holds 32 blocks of the full group and 4 of each sliding group
        # (a 16-token chunk's queries see 35 positions: 3 blocks, 4 where they straddle one).
        described = llm.llm_engine.describe()
        assert described["kv_cache_groups"] == [None, WINDOW, WINDOW]
        assert described["max_concurrency"] == round(35 / (32 + 2 * 4), 2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy("gemma3", tuple(prompt)), len(prompt)
        assert_pool_free(llm)
    finally:
        llm.shutdown()
    llm = make_llm(path, disable_hybrid_kv_cache_manager=True, **args)
    try:
        assert scheduler_state(llm)["num_usable_blocks"] == 12 - 1
        assert llm.llm_engine.describe()["max_concurrency"] == round(11 / 32, 2)
        with pytest.raises(ValueError, match="needs 19 KV blocks"):
            llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)
    finally:
        llm.shutdown()


# --- configs and refusals -----------------------------------------------------------------------


def _hf_dict(name: str, **changes) -> dict:
    cfg = {"architectures": [ARCHITECTURE[name]], "vocab_size": 512, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32}
    cfg.update(changes)
    return cfg


def test_gemma3_configs_as_transformers_reads_them():
    """Older Gemma 3 files (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern; no layer_types) and files that leave everything to the defaults:
    layer types, windows and both RoPEs as transformers' Gemma3TextConfig reads them."""
    import transformers

    for changes in ({"num_hidden_layers": 8, "rope_theta": 500000.0,
                     "rope_local_base_freq": 20000.0, "sliding_window": 512,
                     "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                     "sliding_window_pattern": 3, "max_position_embeddings": 4096},
                    {"num_hidden_layers": 7}):
        raw = _hf_dict("gemma3", **changes)
        hf = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items()
                                              if k != "architectures"})
        cfg = ModelConfig.from_hf_config(raw)
        want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
        assert [cfg.layer_sliding_window(i) for i in range(cfg.num_hidden_layers)] == want
        full, local = hf.rope_parameters["full_attention"], hf.rope_parameters[
            "sliding_attention"]
        assert (cfg.rope_theta, cfg.rope_local_theta) == (full["rope_theta"],
                                                          local["rope_theta"])
        factor = full.get("factor") if full["rope_type"] != "default" else None
        assert (cfg.rope_scaling and cfg.rope_scaling.factor) == factor
        assert cfg.query_pre_attn_scalar == hf.query_pre_attn_scalar
        assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
        assert cfg.max_context_len == hf.max_position_embeddings


def test_gemma2_defaults_are_transformers():
    import transformers

    raw = _hf_dict("gemma2", num_hidden_layers=5)
    hf = transformers.Gemma2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg = ModelConfig.from_hf_config(raw)
    want = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert [cfg.layer_sliding_window(i) for i in range(5)] == want
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping,
            cfg.final_logit_softcapping) == (hf.query_pre_attn_scalar,
                                             hf.attn_logit_softcapping,
                                             hf.final_logit_softcapping)
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    # Null caps: none.
    cfg = ModelConfig.from_hf_config(_hf_dict("gemma2", attn_logit_softcapping=None,
                                              final_logit_softcapping=None))
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    # Gemma's legacy "gelu" is the tanh approximation (as transformers reads it).
    assert ModelConfig.from_hf_config(_hf_dict("gemma", hidden_act="gelu")).hidden_act == \
        "gelu_pytorch_tanh"


@pytest.mark.parametrize("name, changes, words", [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ("gemma", {"hidden_act": "silu"}, "hidden_act 'silu'"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
    ("gemma2", {"layer_types": ["full_attention"]}, "layer_types names 1 layers"),
    ("gemma3", {"sliding_window": None}, "sliding_window null with sliding_attention"),
])
def test_gemma_configs_refused_by_name(name, changes, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_hf_config(_hf_dict(name, **changes))


def test_refusals_at_load_name_the_option(family, tmp_path):
    src, _ = family("gemma3")
    dst = tmp_path / "bidirectional"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["use_bidirectional_attention"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        load_model(dst, progress=False)
