"""Gemma, Gemma 2 and Gemma 3 (text) GGUF files against Hugging Face transformers.

Tiny random checkpoints (float32, head_dim 32 unlike hidden / heads) are converted here as
llama.cpp's convert_hf_to_gguf.py converts them: tensors renamed by gguf's own name map (Gemma
2's and 3's `post_attention_norm`, `ffn_norm` before the MLP, `post_ffw_norm`; Gemma 3's
`attn_q_norm` / `attn_k_norm`), one added to every norm weight, no `output.weight` (the head is
the embedding), and only the metadata the converter writes: Gemma 2's soft caps and window,
Gemma 3's global RoPE base, linear scaling and window. What the file leaves out, llama.cpp
derives, and so do the checkpoints here: q.k scaled by head_dim (query_pre_attn_scalar equal
to it), Gemma 2's window on every other layer, Gemma 3's five sliding layers to one global and
their RoPE base of 10,000. The oracle is transformers on the original checkpoint: the weights
and config read from the file, logits, greedy tokens through LLM with chunked prefill and
prefix hits; a Q8_0 file kept quantized against its dequantized model and, within the
quantization's error, against transformers; a Gemma vocabulary from the file's metadata; what
llama.cpp derives from metadata the converter does not write; what is still refused.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import gguf
import jax
import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.model_executor.config import ModelConfig, RopeScaling
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.registry import get_model_class
from tests.gguf_models import write_skeleton_gguf
from tests.model_inputs import prefill_inputs
from tests.utils import hf_greedy_tokens, hf_prompt_logits, make_llm, tiny_checkpoints

HEAD_DIM = 32  # tests/utils.py TINY_FAMILIES' Gemmas; hidden 64 over 4 heads would be 16
WINDOW = 20
FAMILIES = {
    "gemma": dict(arch="gemma", tied=True, seed=51),
    # Soft caps 2 and 5 (TINY_FAMILIES'), which the tiny weights reach.
    "gemma2": dict(arch="gemma2", tied=True, seed=52, query_pre_attn_scalar=HEAD_DIM),
    # Six layers: llama.cpp's pattern slides on the first five; the global layers' RoPE base
    # 1e6 stretched linearly by 2, the sliding layers' 10,000.
    "gemma3": dict(arch="gemma3", tied=True, seed=53, query_pre_attn_scalar=HEAD_DIM,
                   num_hidden_layers=6, sliding_window_pattern=6,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
}
GGUF_ARCH = {"gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
LOGIT_LENS = [1, 9, 64, 120]
MAX_NEW = 12


# --- llama.cpp's conversion ----------------------------------------------------------------------


def write_gemma_gguf(path, hf, ftype: str = "F32", vocab: list[str] | None = None,
                     drop: tuple[str, ...] = ()) -> None:
    """`hf` as convert_hf_to_gguf.py's GemmaModel / Gemma2Model / Gemma3Model write it, its
    matrices as `ftype` (F32, F16, BF16 or Q8_0, gguf's own quantizer), vectors F32; with
    `vocab`, a SentencePiece vocabulary as its `_set_vocab_sentencepiece` lays one out (pad,
    eos, bos and unk first, as Gemma's); without the tensors named in `drop` (GGUF names)."""
    cfg = hf.config
    arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
    elif arch == "gemma3":
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if cfg.final_logit_softcapping:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
        writer.add_sliding_window(cfg.sliding_window)
        if full["rope_type"] == "linear":  # the global layers' alone, in llama.cpp
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    if vocab is not None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(vocab)
        writer.add_token_scores([-float(i) for i in range(len(vocab))])
        writer.add_token_types([gguf.TokenType.CONTROL] * 4
                               + [gguf.TokenType.NORMAL] * (len(vocab) - 4))
        writer.add_pad_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_bos_token_id(2)
        writer.add_unk_token_id(3)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        writer.add_add_space_prefix(False)
    state = hf.state_dict()
    for hf_name, name in gguf_names(hf).items():
        if name in drop:
            continue
        data = state[hf_name].detach().float().numpy().copy()
        if hf_name.endswith("norm.weight"):  # Gemma's RMSNorm scales by 1 + weight
            data = data + np.float32(1.0)
        if data.ndim == 1 or ftype == "F32":
            writer.add_tensor(name, data.astype(np.float32))
        elif ftype == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[ftype]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_names(hf) -> dict[str, str]:
    """Each of `hf`'s tensors the converter writes -> its GGUF name (gguf's name map)."""
    cfg = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[cfg.model_type].upper()],
                                     cfg.num_hidden_layers)
    out = {}
    for hf_name in hf.state_dict():
        if hf_name == "lm_head.weight":  # the converter skips it: llama.cpp ties the head
            continue
        out[hf_name] = names.get_name(hf_name, try_suffixes=(".weight",))
        assert out[hf_name] is not None, hf_name
    return out


def hf_holding_file_weights(hf, path):
    """A copy of `hf` holding the weights a GGUF of it stores, as gguf dequantizes them (the
    norms' one taken off again)."""
    from jaxllm.model_executor.model_loader.gguf_file import read_gguf

    tensors = {t.name: t for t in read_gguf(path).tensors}
    state = {}
    for hf_name, name in gguf_names(hf).items():
        t = tensors[name]
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
            tuple(reversed([int(d) for d in t.shape])))
        if hf_name.endswith("norm.weight"):
            data = data - np.float32(1.0)
        state[hf_name] = torch.from_numpy(np.array(data, np.float32))
    model = copy.deepcopy(hf)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


# --- fixtures: one checkpoint, file and load per family and type ---------------------------------


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def gguf_file(family, tmp_path_factory):
    @functools.cache
    def write(name: str, ftype: str = "F32"):
        path = tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}-{ftype}.gguf"
        write_gemma_gguf(path, family(name)[1], ftype)
        return path

    return write


@pytest.fixture(scope="module")
def loaded(gguf_file):
    return functools.cache(lambda name, ftype="F32": load_model(gguf_file(name, ftype),
                                                               progress=False))


@pytest.fixture(scope="module")
def hf_loaded(family):
    return functools.cache(lambda name: load_model(family(name)[0], progress=False))


def _logits(loaded, prompts: list[list[int]]) -> list[np.ndarray]:
    """The loaded model's logits of every token of each prompt (one batch, jitted: faster here
    than op by op)."""
    model = get_model_class(loaded.config.architecture)(loaded.config)
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    logits, _, _ = jax.jit(model.apply)({"params": loaded.params,
                                         "rope": rope_variables(loaded.config)},
                                        ids, pos, kv, md)
    bounds = np.cumsum([0] + [len(p) for p in prompts])
    return [np.asarray(logits)[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _leaves(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


# --- the checkpoints and files are what they claim ----------------------------------------------


def test_files_are_laid_out_as_llama_cpp_converts(family, gguf_file):
    """gguf's name map gives llama.cpp's names (the sandwich norms, q/k norms), each norm holds
    one plus Hugging Face's weight, there is no head, and only the converter's metadata."""
    from jaxllm.model_executor.model_loader.gguf_file import read_gguf

    for name in FAMILIES:
        hf = family(name)[1]
        file = read_gguf(gguf_file(name))
        tensors = {t.name: t for t in file.tensors}
        layer = {n.split(".", 2)[2] for n in tensors if n.startswith("blk.0.")}
        want = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight",
                "ffn_down.weight"}
        if name != "gemma":
            want |= {"post_attention_norm.weight", "post_ffw_norm.weight"}
        if name == "gemma3":
            want |= {"attn_q_norm.weight", "attn_k_norm.weight"}
        assert layer == want, name
        assert "output.weight" not in tensors
        hf_norm = hf.model.layers[0].pre_feedforward_layernorm if name != "gemma" \
            else hf.model.layers[0].post_attention_layernorm
        np.testing.assert_array_equal(tensors["blk.0.ffn_norm.weight"].data,
                                      hf_norm.weight.detach().numpy() + np.float32(1))
        keys = {k.split(".", 1)[1] for k in file.metadata if k.startswith(name + ".")}
        assert not {"attention.sliding_window_pattern", "rope.freq_base_swa",
                    "query_pre_attn_scalar"} & keys
        assert ("attn_logit_softcapping" in keys) == (name == "gemma2")
        assert ("rope.freq_base" in keys) == (name == "gemma3")


def _hf_logits_with(hf, prompt: list[int], changes: Sequence[tuple[Any, str, Any]]
                    ) -> np.ndarray:
    """HF's logits of `prompt` with these (object, attribute, value) set for the call."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in changes]
    try:
        for obj, attr, value in changes:
            setattr(obj, attr, value)
        return hf_prompt_logits(hf, prompt)
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def test_checkpoints_exercise_what_llama_cpp_derives(family):
    """What the GGUF path must get right changes Hugging Face's logits: Gemma 3's sliding
    layers' own RoPE (here the global one instead), its window, its one global layer; Gemma
    2's soft caps and its window on every other layer."""
    prompt = np.random.default_rng(1).integers(0, 512, 120).tolist()
    for name in ("gemma2", "gemma3"):
        _, hf = family(name)
        cfg, attns = hf.config, [layer.self_attn for layer in hf.model.layers]
        base = hf_prompt_logits(hf, prompt)
        windowless = _hf_logits_with(hf, prompt, [(cfg, "sliding_window", 10**6)] + [
            (a, "sliding_window", 10**6) for a in attns if a.sliding_window is not None])
        assert np.abs(windowless - base)[WINDOW:].max() > 1e-2, name
        if name == "gemma2":
            assert [a.sliding_window for a in attns] == [WINDOW, None]
            for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
                changes = [(cfg, cap, None)] + [(a, cap, None) for a in attns if hasattr(a, cap)]
                assert np.abs(_hf_logits_with(hf, prompt, changes) - base).max() > 1e-2, cap
            continue
        assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        every = _hf_logits_with(hf, prompt, [(cfg, "layer_types", ["sliding_attention"] * 6)])
        assert np.abs(every - base)[WINDOW:].max() > 1e-2
        rope = hf.model.rotary_emb
        local = rope.sliding_attention_inv_freq.clone()
        try:
            with torch.no_grad():
                rope.sliding_attention_inv_freq.copy_(rope.full_attention_inv_freq)
            assert np.abs(hf_prompt_logits(hf, prompt) - base).max() > 1e-2
        finally:
            with torch.no_grad():
                rope.sliding_attention_inv_freq.copy_(local)


# --- the config and weights read from the file are the checkpoint's ----------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_and_weights_are_the_checkpoints(loaded, hf_loaded, name):
    """Every field the model runs with, as read from config.json, and every weight bit for bit
    (the norms' 1 + weight included, held in float32)."""
    got, want = loaded(name), hf_loaded(name)
    for field in ("architecture", "hidden_act", "head_dim", "num_key_value_heads",
                  "query_pre_attn_scalar", "attention_scale", "attn_logit_softcapping",
                  "final_logit_softcapping", "sliding_window", "full_attention_layers",
                  "rope_theta", "rope_local_theta", "rope_scaling", "rope_local_scaling",
                  "tie_word_embeddings", "max_position_embeddings", "max_context_len",
                  "vocab_size"):
        a, b = getattr(got.config, field), getattr(want.config, field)
        assert a == (pytest.approx(b, rel=1e-7) if isinstance(b, float) else b), field
    assert got.config.rms_norm_eps == pytest.approx(want.config.rms_norm_eps, rel=1e-6)
    ours, theirs = _leaves(got.params), _leaves(want.params)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype, key
        np.testing.assert_array_equal(value, theirs[key], err_msg=key)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_float32_gguf_logits_match_hf(family, loaded, name):
    _, hf = family(name)
    prompts = [np.random.default_rng(2).integers(0, 512, n).tolist() for n in LOGIT_LENS]
    for prompt, got in zip(prompts, _logits(loaded(name), prompts), strict=True):
        np.testing.assert_allclose(got, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {len(prompt)} tokens")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_through_llm_match_hf(family, gguf_file, name):
    """LLM over the file (16-token steps chunk every prefill): a 100-token prompt, then one
    sharing 64 of its tokens (a prefix-cache hit) beside a short one; every prompt but the
    short one runs past the window."""
    _, hf = family(name)
    rng = np.random.default_rng(3)
    base = rng.integers(0, 512, 100).tolist()
    batch = [base[:64] + rng.integers(0, 512, 20).tolist(), rng.integers(0, 512, 5).tolist()]
    llm = make_llm(gguf_file(name), dtype="float32", max_model_len=128,
                   max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        first = llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
    finally:
        llm.shutdown()
    assert outs[0].num_cached_tokens >= 48
    for prompt, out in zip([base, *batch], first + outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW), \
            f"{name}, {len(prompt)} tokens"


# --- other tensor types -------------------------------------------------------------------------


@pytest.mark.parametrize("ftype", ["F16", "BF16"])
def test_half_precision_files_load_their_values(loaded, ftype):
    """Matrices stored in half precision load as those values exactly (float32); the norms,
    stored F32 by the converter, are the float32 file's."""
    half, full = _leaves(loaded("gemma2", ftype).params), _leaves(loaded("gemma2").params)
    dtype = {"F16": np.float16, "BF16": jax.numpy.bfloat16}[ftype]
    for key, value in half.items():
        want = full[key] if "norm" in key else full[key].astype(dtype).astype(np.float32)
        np.testing.assert_array_equal(value, want, err_msg=key)


# Q8_0's rounding (a step of max|w| / 127 per 32 weights) moves the logits of this Gemma 2
# (weights ten times transformers' initialization, soft caps) by up to 0.18 (measured) of
# logits within +-4.5.
Q8_0_LOGITS_ATOL = 0.25


def test_q8_0_kept_quantized(family, gguf_file, loaded):
    """Gemma 2 (soft caps, window) from a Q8_0 file with quantization="gguf": its matrices and
    tied embedding kept as blocks (our CPU kernel's panels where it is built, else XLA's GEMV
    tree). Its logits are the file's dequantized model's (a float32 load) and transformers'
    holding the file's weights, within Q8_0_LOGITS_ATOL of the original checkpoint's; greedy
    tokens through LLM (which keeps the blocks by default) are transformers' over the file's
    weights."""
    from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul

    path = gguf_file("gemma2", "Q8_0")
    cpu_kernel = cpu_dequant_matmul.available()
    quantized = load_model(path, progress=False, quantization="gguf",
                           gguf_layout="panels" if cpu_kernel else "rows")
    tree = quantized.params if cpu_kernel else quantized.gemv_params
    assert tree is not None
    for weight in (tree["embed_tokens"], tree["layers_1"]["self_attn"]["qkv_proj"]["weight"],
                   tree["layers_1"]["mlp"]["gate_up_proj"]["weight"]):
        assert isinstance(weight, GGUFWeight)
    _, original = family("gemma2")
    hf = hf_holding_file_weights(original, path)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 60)]
    got = _logits(dataclasses.replace(quantized, params=tree), prompts)
    dense = _logits(loaded("gemma2", "Q8_0"), prompts)
    for prompt, g, d in zip(prompts, got, dense, strict=True):
        np.testing.assert_allclose(g, d, atol=1e-4, rtol=0)
        np.testing.assert_allclose(g, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0)
        np.testing.assert_allclose(g, hf_prompt_logits(original, prompt),
                                   atol=Q8_0_LOGITS_ATOL, rtol=0)
    prompts = [rng.integers(0, 512, 40).tolist(), rng.integers(0, 512, 5).tolist()]
    llm = make_llm(path, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
            temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW)


# --- the vocabulary in the file's metadata -----------------------------------------------------


def _sentencepiece_vocab(size: int) -> list[str]:
    """Gemma's special tokens, single characters, then pieces merged from them."""
    # Each merged piece splits into two earlier pieces, so the merges rebuilt from the
    # vocabulary reach it.
    words = ["he", "ll", "llo", "hello", "▁w", "or", "ld", "orld", "▁world", "▁t", "▁th",
             "▁the"]
    chars = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["<pad>", "<eos>", "<bos>", "<unk>", *chars, *words]
    return vocab + [f"<unused{i}>" for i in range(size - len(vocab))]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gemma_vocabulary_from_gguf_metadata(family, tmp_path, monkeypatch, name):
    """A SentencePiece vocabulary as llama.cpp's converter stores Gemma's (no merges, no space
    prefix, bos added) becomes a tokenizer, Gemma 1's too (whose config transformers does not
    read from a GGUF): text encodes to the file's pieces after <bos>, and decodes back."""
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path / "cache"))
    vocab = _sentencepiece_vocab(512)
    path = tmp_path / f"{name}-vocab.gguf"
    write_gemma_gguf(path, family(name)[1], vocab=vocab)
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode("hello world the")
    assert [vocab[i] for i in ids] == ["<bos>", "hello", "▁world", "▁the"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world the"
    assert load_model(path, progress=False).config.eos_token_ids == (1,)


# --- llama.cpp's derivations from metadata the converter does not write -------------------------


def _meta(arch: str, layers: int = 4, **extra) -> dict:
    return {"general.architecture": arch, f"{arch}.block_count": layers,
            f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.attention.key_length": HEAD_DIM, f"{arch}.context_length": 256,
            **{f"{arch}.{k}": v for k, v in extra.items()}}


def _windows(config: ModelConfig) -> list[int | None]:
    return [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)]


def test_llama_cpp_defaults_and_derivations():
    gemma = ModelConfig.from_gguf_metadata(_meta("gemma", **{"attention.sliding_window": 16}),
                                           512, tied=True)
    assert (gemma.architecture, gemma.hidden_act, gemma.attention_scale, _windows(gemma)) == (
        "GemmaForCausalLM", "gelu_pytorch_tanh", HEAD_DIM ** -0.5, [None] * 4)
    # Gemma 2 with nothing but the shapes: llama.cpp's caps, window and period.
    gemma2 = ModelConfig.from_gguf_metadata(_meta("gemma2"), 512, tied=True)
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping,
            gemma2.query_pre_attn_scalar) == (50.0, 30.0, HEAD_DIM)
    assert _windows(gemma2) == [4096, None, 4096, None] and gemma2.rope_local_theta is None
    # The 27B models' scalar is hidden / heads (llama.cpp tells them by their layer count).
    for arch, layers in (("gemma2", 46), ("gemma3", 62)):
        config = ModelConfig.from_gguf_metadata(_meta(arch, layers, **{
            "attention.sliding_window": 16}), 512, tied=True)
        assert config.query_pre_attn_scalar == 16, arch
    # Gemma 3: five sliding layers to one, their RoPE base 10,000 and unscaled.
    gemma3 = ModelConfig.from_gguf_metadata(_meta("gemma3", 7, **{
        "attention.sliding_window": 16, "rope.freq_base": 1e6, "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0}), 512, tied=True)
    assert _windows(gemma3) == [16] * 5 + [None, 16]
    assert (gemma3.rope_theta, gemma3.rope_scaling, gemma3.rope_local_theta,
            gemma3.rope_local_scaling) == (1e6, RopeScaling("linear", factor=8.0), 1e4, None)
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None
    # Newer llama.cpp's keys where a file has them: a period or per-layer flags, a local base.
    config = ModelConfig.from_gguf_metadata(_meta("gemma3", **{
        "attention.sliding_window": 16, "attention.sliding_window_pattern": 2,
        "rope.freq_base_swa": 100.0, "final_logit_softcapping": 30.0}), 512, tied=True)
    assert _windows(config) == [16, None, 16, None]
    assert (config.rope_local_theta, config.final_logit_softcapping) == (100.0, 30.0)
    config = ModelConfig.from_gguf_metadata(_meta("gemma3", **{
        "attention.sliding_window": 16,
        "attention.sliding_window_pattern": [False, True, True, False]}), 512, tied=True)
    assert _windows(config) == [None, 16, 16, None]
    # No window (or 0), or a final cap of 0: none.
    for extra in ({}, {"attention.sliding_window": 0, "final_logit_softcapping": 0.0}):
        config = ModelConfig.from_gguf_metadata(_meta("gemma3", **extra), 512, tied=True)
        assert _windows(config) == [None] * 4 and config.rope_local_theta is None
        assert config.final_logit_softcapping is None


# --- what is refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gemma3n", "gemma4", "gemma-embedding"])
def test_other_gemma_architectures_are_refused_by_name(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_skeleton_gguf(path, arch)
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    message = str(e.value).replace(str(path), "")
    assert f"GGUF architecture {arch!r} is not supported" in message, message
    assert "gemma, gemma2, gemma3" in message, message


def test_a_file_without_a_norm_is_refused_naming_it(family, tmp_path):
    path = tmp_path / "no-post-ffw-norm.gguf"
    write_gemma_gguf(path, family("gemma2")[1], drop=("blk.1.post_ffw_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensor layers\.1\."
                                             r"post_feedforward_layernorm\.weight \(GGUF "
                                             r"blk\.1\.post_ffw_norm\.weight\)"):
        load_model(path, progress=False)


@pytest.mark.parametrize("extra, words", [
    ({"attention.sliding_window": 16, "attention.sliding_window_pattern": [True, False]},
     "sliding_window_pattern must flag each of the 4 layers"),
    ({"attention.sliding_window": 16, "attention.sliding_window_pattern": -1},
     "sliding_window_pattern must be a period"),
    ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be a finite number > 0"),
])
def test_bad_gemma_metadata_is_refused_by_name(extra, words):
    arch = "gemma2" if "attn_logit_softcapping" in extra else "gemma3"
    with pytest.raises(ValueError, match=words):
        ModelConfig.from_gguf_metadata(_meta(arch, **extra), 512, tied=True)
