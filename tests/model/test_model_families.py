"""Every supported family against Hugging Face transformers on tiny random checkpoints.

Qwen3 (per-head q/k RMSNorm before RoPE, no q/k/v biases, head_dim 32 where hidden_size /
num_attention_heads is 16), Llama 3 (its scaled RoPE, untied; a tied one with linear scaling
and `attention_bias`: biases on q, k, v and o_proj),
YaRN (a tied Qwen3) and Mistral without a sliding window, each chosen by the checkpoint's
`architectures` through the model registry: batch logits with the reference and the Pallas
(interpret) kernels, greedy tokens through LLM, and the same tokens under preemption, chunked
prefill and prefix-cache hits. Prompts run to position ~200, past the 64 positions the scaled
RoPEs were "trained" on. A foreign architecture is refused by name. Sliding windows (Mistral's
on every layer, Qwen2's on the layers past max_window_layers) run the whole context: logits and
greedy tokens far past the window are HF's windowed model's.
"""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from tests.gguf_models import write_skeleton_gguf
from tests.model_inputs import prefill_logits
from tests.utils import (
    YARN_ROPE,
    assert_pool_free,
    hf_greedy_tokens,
    hf_prompt_logits,
    make_llm,
    make_tiny_checkpoint,
    random_prompts,
    scheduler_state,
    tiny_checkpoints,
)

# name -> make_tiny_checkpoint arguments.
FAMILIES = {
    "qwen3": dict(arch="qwen3", tied=False, seed=11),
    "qwen3_yarn_tied": dict(arch="qwen3", tied=True, seed=12, rope_scaling=YARN_ROPE,
                            max_position_embeddings=256),
    "llama3": dict(arch="llama", tied=False, seed=13),
    "llama_linear_tied": dict(arch="llama", tied=True, seed=14, attention_bias=True,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(arch="mistral", tied=False, seed=15),
}
ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM"}
SUPPORTED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")

LOGIT_LENS = [1, 9, 64, 130, 200]
GREEDY_LENS = [3, 40, 150]
MAX_NEW = 16
# max_position_embeddings of the YaRN checkpoint (64 x 4); every prompt + MAX_NEW fits.
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """family(name) -> (checkpoint path, HF model): each built once, when first asked for."""
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def hf_greedy(family):
    @functools.cache
    def run(name: str, prompt: tuple[int, ...]) -> list[int]:
        _, hf = family(name)
        with torch.no_grad():
            out = hf_greedy_tokens(hf, list(prompt), MAX_NEW)
        return out

    return run


def our_logits(loaded, prompts: list[list[int]], kernel_backend: str) -> list[np.ndarray]:
    return prefill_logits(loaded, prompts, kernel_backend=kernel_backend)


def _greedy(llm, prompts: list[list[int]]):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


# --- the checkpoints are what they claim: each family's features are live in the HF model --------


def test_tiny_families_exercise_their_features(family):
    """The oracle's side: q/k norms away from one, head_dim unlike hidden / heads, RoPE scaling
    that changes the frequencies, tied heads where asked, no sliding window for Mistral."""
    _, qwen3 = family("qwen3")
    attn = qwen3.model.layers[0].self_attn
    assert qwen3.config.head_dim == 32 != qwen3.config.hidden_size // 4
    assert attn.q_proj.bias is None
    assert not torch.allclose(attn.q_norm.weight, torch.ones(32))
    assert not torch.allclose(attn.k_norm.weight, torch.ones(32))
    for name, rope_type in (("llama3", "llama3"), ("qwen3_yarn_tied", "yarn"),
                            ("llama_linear_tied", "linear")):
        path, hf = family(name)
        assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] \
            == rope_type
        plain = 1.0 / (10000.0 ** (np.arange(0, hf.config.head_dim, 2) / hf.config.head_dim))
        scaled = hf.model.rotary_emb.inv_freq.numpy()
        assert not np.allclose(scaled, plain, rtol=1e-3), name
    for name in ("qwen3_yarn_tied", "llama_linear_tied"):
        hf = family(name)[1]
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    path, mistral = family("mistral")
    assert json.loads((path / "config.json").read_text())["sliding_window"] is None
    attn = family("llama_linear_tied")[1].model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        assert proj.bias is not None and proj.bias.abs().min() > 0


# --- (a) logits, both kernel backends --------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batch_logits_match_hf(family, name):
    from jaxllm.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

    path, hf = family(name)
    loaded = load_model(path, progress=False)
    arch = ARCHITECTURE[FAMILIES[name]["arch"]]
    assert loaded.config.architecture == arch
    assert arch in SUPPORTED_ARCHITECTURES and isinstance(get_model_class(arch), type)
    prompts = random_prompts(1, LOGIT_LENS)
    want = [hf_prompt_logits(hf, p) for p in prompts]
    for backend in ("reference", "interpret"):
        got = our_logits(loaded, prompts, backend)
        for prompt, g, w in zip(prompts, got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0,
                                       err_msg=f"{name}, {backend}, {len(prompt)} tokens")


# --- (b) greedy tokens through the engine -------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generate_matches_hf(family, hf_greedy, name):
    path, _ = family(name)
    llm = make_llm(path, dtype="float32", max_model_len=MAX_MODEL_LEN)
    prompts = random_prompts(2, GREEDY_LENS)
    outs = _greedy(llm, prompts)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(name, tuple(prompt)), \
            f"{name}, prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    llm.shutdown()


# --- (c) preemption, chunked prefill and prefix caching ------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_preemption_chunked_prefill_and_prefix_cache_keep_hf_tokens(family, hf_greedy, name):
    """14 KV blocks of 16 tokens (13 usable: the 166 tokens of the longest request fit alone,
    not beside the others) force preemption; a 16-token step budget chunks every prefill; two
    prompts share 64 and 80 tokens with one run before them, which the prefix cache serves."""
    path, _ = family(name)
    rng = np.random.default_rng(3)
    base = rng.integers(0, 512, 100).tolist()
    batch = [base[:64] + rng.integers(0, 512, 5).tolist(),
             base[:80] + rng.integers(0, 512, 12).tolist(),
             rng.integers(0, 512, 150).tolist(),
             rng.integers(0, 512, 9).tolist()]
    llm = make_llm(path, dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=14,
                   max_num_batched_tokens=16, max_num_seqs=4)
    first = _greedy(llm, [base])
    assert first[0].outputs[0].token_ids == hf_greedy(name, tuple(base))
    outs = _greedy(llm, batch)
    for prompt, out in zip(batch, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(name, tuple(prompt)), \
            f"{name}, prompt of {len(prompt)} tokens"
    assert outs[0].num_cached_tokens >= 48  # full blocks of the shared 64-token prefix
    assert scheduler_state(llm)["num_preemptions"] > 0
    llm.shutdown()


# --- (d) refusals -------------------------------------------------------------------------------


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_registry_names_the_supported_architectures():
    from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from jaxllm.model_executor.models.registry import SUPPORTED_ARCHITECTURES, get_model_class

    assert set(SUPPORTED) <= set(SUPPORTED_ARCHITECTURES)
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    with pytest.raises(ValueError) as e:
        get_model_class("GPT2LMHeadModel")
    assert "GPT2LMHeadModel" in str(e.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_unsupported_architecture_is_refused_by_name(family, tmp_path):
    from jaxllm.model_executor.models.registry import SUPPORTED_ARCHITECTURES

    path = _with_config(family("llama3")[0], tmp_path / "foreign",
                        architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    message = str(e.value).replace(str(path), "")  # what it says beyond naming the path
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_unsupported_gguf_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "foreign.gguf"
    write_skeleton_gguf(path, "gpt2")
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    message = str(e.value).replace(str(path), "")
    assert "gpt2" in message
    # The supported families, by GGUF name or Hugging Face architecture.
    for arch in ("qwen2", "qwen3", "llama"):
        assert arch in message.lower()


# A window of 24 positions, far shorter than the prompts below (up to position ~170).
WINDOW = 24


def _windowed(family, tmp_path, name):
    """(checkpoint, HF model, the same weights' HF model without a window, per-layer windows):
    Mistral slides on every layer; Qwen2 with use_sliding_window and max_window_layers 1 on
    its second layer only."""
    from transformers import AutoModelForCausalLM

    if name == "mistral":
        path = _with_config(family("mistral")[0], tmp_path / "windowed", sliding_window=WINDOW)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        windows = [WINDOW, WINDOW]
    else:
        path = tmp_path / "qwen2"
        hf = make_tiny_checkpoint(path, arch="qwen2", tied=False, seed=16,
                                  use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1)
        windows = [None, WINDOW]
    assert _hf_windows(hf) == windows
    full = AutoModelForCausalLM.from_pretrained(
        _with_config(path, tmp_path / "full", sliding_window=None, use_sliding_window=False,
                     **({} if name == "mistral" else {"layer_types": None})),
        dtype=torch.float32).eval()
    assert _hf_windows(full) == [None, None]
    return path, hf, full, windows


def _hf_windows(hf) -> list[int | None]:
    """Each layer's window as transformers runs it (Mistral's attention reads the config's)."""
    return [getattr(layer.self_attn, "sliding_window", hf.config.sliding_window)
            for layer in hf.model.layers]


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_a_sliding_window_runs_past_the_window(family, tmp_path, name):
    """The engine takes the model's whole context, and positions far past the window are HF's
    windowed model's: logits on both kernel backends, greedy tokens through LLM with chunked
    prefill (16-token steps) and a prefix-cache hit (the second prompt shares 96 tokens)."""
    path, hf, full, windows = _windowed(family, tmp_path, name)
    loaded = load_model(path, progress=False)
    assert [loaded.config.layer_sliding_window(i) for i in range(2)] == windows
    prompts = random_prompts(7, [150, 40])
    want = [hf_prompt_logits(hf, p) for p in prompts]
    # The window counts: without it the logits past the window are another model's, by far
    # more than the tolerance below.
    assert np.abs(hf_prompt_logits(full, prompts[0]) - want[0])[WINDOW:].max() > 1e-3
    for backend in ("reference", "interpret"):
        for got, ref in zip(our_logits(loaded, prompts, backend), want, strict=True):
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=backend)

    llm = make_llm(path, dtype="float32", max_model_len=None, max_num_batched_tokens=16,
                   enable_prefix_caching=True)
    assert llm.llm_engine.max_model_len == 512  # max_position_embeddings, not the window
    base = random_prompts(8, [150])[0]
    second = base[:96] + random_prompts(9, [30])[0]
    for prompt in (base, second):
        out = _greedy(llm, [prompt])[0]
        with torch.no_grad():
            assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW), \
                f"{name}, prompt of {len(prompt)} tokens"
    assert out.num_cached_tokens >= 80  # full blocks of the shared prefix
    llm.shutdown()


def test_a_window_on_every_layer_frees_the_blocks_behind_it(family, tmp_path):
    """Mistral slides on every layer: a sequence holds only its window's KV blocks, so one
    longer than the whole KV pool still runs to its max_tokens with HF's windowed tokens."""
    path, hf, _, _ = _windowed(family, tmp_path, "mistral")
    # 7 usable blocks of 16 tokens: 112 positions, less than the 160 the sequence reaches.
    llm = make_llm(path, dtype="float32", max_model_len=None, max_num_batched_tokens=16,
                   num_kv_blocks=8)
    prompt = random_prompts(10, [100])[0]
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    with torch.no_grad():
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 60)
    # The prompt's first blocks, freed first, were evicted by the sequence's own growth; a
    # prompt sharing it hits on the blocks of its first query's window.
    follow = prompt + random_prompts(11, [8])[0]
    out = _greedy(llm, [follow])[0]
    assert out.num_cached_tokens == 96
    with torch.no_grad():
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, follow, MAX_NEW)
    # A prompt longer than the pool is computed chunk by chunk behind its window.
    long = random_prompts(12, [130])[0]
    out = _greedy(llm, [long])[0]
    with torch.no_grad():
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, long, MAX_NEW)
    assert_pool_free(llm)
    llm.shutdown()


# --- GGUF files of these families, converted as llama.cpp converts them --------------------------


@pytest.mark.parametrize("arch, kw", [
    ("qwen3", dict(tied=True, head_dim=128)),  # transformers reads no head_dim for qwen3
    ("llama", dict(tied=False, rope_scaling=None)),  # nor RoPE scaling for llama
    ("mistral", dict(tied=False)),  # written as "llama", as llama.cpp does
], ids=["qwen3", "llama", "mistral"])
def test_gguf_writer_is_read_back_by_transformers(tmp_path, arch, kw):
    """The writer's files against transformers' own GGUF reader (config from the metadata,
    tensors renamed and Llama's q/k permutation undone): the original model's logits."""
    from tests.gguf_models import hf_from_gguf, write_gguf_from_hf

    hf = make_tiny_checkpoint(tmp_path, arch=arch, seed=21, **kw)
    write_gguf_from_hf(tmp_path / "model.gguf", hf)
    back = hf_from_gguf(tmp_path / "model.gguf")
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    prompt = random_prompts(4, [60])[0]
    np.testing.assert_allclose(hf_prompt_logits(back, prompt), hf_prompt_logits(hf, prompt),
                               atol=1e-5, rtol=0)


def test_llama3_rope_freqs_tensor_is_hf_scaling(family):
    """llama.cpp's form of Llama 3's RoPE scaling (a `rope_freqs` tensor dividing each
    frequency) gives transformers' scaled frequencies."""
    from tests.gguf_models import llama3_rope_factors

    _, hf = family("llama3")
    dim, rope = hf.config.head_dim, hf.config.rope_parameters
    plain = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factors = llama3_rope_factors(dim, rope["rope_theta"], rope)
    assert (factors == 1).any() and (factors == rope["factor"]).any()  # every band is hit
    assert ((factors > 1) & (factors < rope["factor"])).any()
    np.testing.assert_allclose(plain / factors, hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


GGUF_FAMILIES = ["qwen3", "qwen3_yarn_tied", "llama3", "llama_linear_tied", "mistral"]
GGUF_ARCHITECTURE = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                     "mistral": "LlamaForCausalLM"}


@pytest.fixture(scope="module")
def gguf_file(family, tmp_path_factory):
    """gguf_file(name, ftype) -> path of the family's checkpoint converted to GGUF."""
    from tests.gguf_models import write_gguf_from_hf

    @functools.cache
    def build(name: str, ftype: str):
        path = tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}-{ftype}.gguf"
        write_gguf_from_hf(path, family(name)[1], ftype)
        return path

    return build


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_float32_gguf_matches_hf(family, gguf_file, hf_greedy, name):
    """A float32 GGUF of each family: transformers reads back the original tensors from it
    (given the original config), and our loader gives the original model's logits and, through
    LLM, its greedy tokens."""
    from tests.gguf_models import hf_from_gguf

    _, hf = family(name)
    path = gguf_file(name, "F32")
    # Mistral's file says "llama" (gguf-py has no "mistral" to map its tensors by) and holds
    # plain RoPE, which transformers reads from the file's metadata.
    config = None if hf.config.model_type == "mistral" else hf.config
    back = hf_from_gguf(path, config=config).state_dict()
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(back[key], value, atol=0, rtol=0, msg=key)
    loaded = load_model(path, progress=False)
    assert loaded.config.architecture == GGUF_ARCHITECTURE[FAMILIES[name]["arch"]]
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    prompts = random_prompts(1, LOGIT_LENS)
    for prompt, got in zip(prompts, our_logits(loaded, prompts, "reference"), strict=True):
        np.testing.assert_allclose(got, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0,
                                   err_msg=f"{name}, {len(prompt)} tokens")
    llm = make_llm(path, dtype="float32", quantization="none", max_model_len=MAX_MODEL_LEN)
    prompts = random_prompts(2, GREEDY_LENS)
    for prompt, out in zip(prompts, _greedy(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(name, tuple(prompt)), \
            f"{name}, prompt of {len(prompt)} tokens"
    llm.shutdown()


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_q8_0_gguf_kept_quantized_matches_hf(family, gguf_file, name):
    """A Q8_0 GGUF run with quantization="gguf" against transformers holding the weights gguf
    dequantizes from the file (in the original model: RoPE scaling included): logits within
    1e-3, greedy tokens equal."""
    from tests.gguf_models import hf_from_gguf

    _, hf = family(name)
    path = gguf_file(name, "Q8_0")
    oracle = hf_from_gguf(path, config=hf.config)
    assert not torch.equal(oracle.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    loaded = load_model(path, progress=False, quantization="gguf")
    assert loaded.config.architecture == GGUF_ARCHITECTURE[FAMILIES[name]["arch"]]
    prompts = random_prompts(1, [9, 130])
    for prompt, got in zip(prompts, our_logits(loaded, prompts, "reference"), strict=True):
        np.testing.assert_allclose(got, hf_prompt_logits(oracle, prompt), atol=1e-3, rtol=0)
    llm = make_llm(path, quantization="gguf", max_model_len=MAX_MODEL_LEN)
    prompts = random_prompts(2, GREEDY_LENS)
    for prompt, out in zip(prompts, _greedy(llm, prompts), strict=True):
        with torch.no_grad():
            ref = hf_greedy_tokens(oracle, list(prompt), MAX_NEW)
        assert out.outputs[0].token_ids == ref, len(prompt)
    llm.shutdown()


# --- chat templates -----------------------------------------------------------------------------

LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]


def _llama3_style_tokenizer():
    """A small byte-level BPE tokenizer (under 512 tokens: the tiny model's vocabulary) that, as
    Llama 3's, puts <|begin_of_text|> before every encoded text, with a Llama-3-style chat
    template that writes it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["You are a helpful assistant.", "Write a Python function that reverses a string.",
              "def reverse(s):\n    return s[::-1]\n", "Hello! How can I help you today?"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", chat_template=LLAMA3_CHAT_TEMPLATE)


def test_chat_prompt_ids_are_the_chat_templates(family, hf_greedy, tmp_path):
    """LLM.chat over a Llama checkpoint holding a Llama-3-style tokenizer: the prompt's token ids
    are transformers' apply_chat_template(..., add_generation_prompt=True) (one
    <|begin_of_text|>: the template's, none added again by encoding), and the tokens generated
    from them HF's greedy ones."""
    src, _ = family("llama3")
    path = tmp_path / "llama3_chat"
    shutil.copytree(src, path)
    tokenizer = _llama3_style_tokenizer()
    assert len(tokenizer) <= 512
    tokenizer.save_pretrained(path)
    conversations = [
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Write a Python function that reverses a string."}],
        [{"role": "user", "content": "Hello!"}],
    ]
    want = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for c in conversations]
    bos = tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in want)
    llm = make_llm(path, skip_tokenizer_init=False, dtype="float32", max_model_len=MAX_MODEL_LEN)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.chat(conversations, sp, use_tqdm=False)
    for ids, out in zip(want, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy("llama3", tuple(ids))
    llm.shutdown()
