"""ModelConfig from Hugging Face configs and GGUF metadata: the families, RoPE scalings,
end-of-generation tokens, and what the registry refuses (by name)."""

from __future__ import annotations

import json

import pytest

from jaxllm.model_executor.config import ModelConfig, RopeScaling
from jaxllm.model_executor.models.llama import LlamaForCausalLM
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from jaxllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from jaxllm.model_executor.models.registry import (
    SUPPORTED_ARCHITECTURES,
    check_supported,
    get_model_class,
)

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _cfg(**kw) -> ModelConfig:
    return ModelConfig.from_hf_config({**BASE, **kw})


@pytest.mark.parametrize(("fields", "architecture", "cls", "bias"), [
    ({"architectures": ["Qwen2ForCausalLM"]}, "Qwen2ForCausalLM", Qwen2ForCausalLM, True),
    ({"model_type": "qwen2"}, "Qwen2ForCausalLM", Qwen2ForCausalLM, True),
    ({"architectures": ["Qwen3ForCausalLM"]}, "Qwen3ForCausalLM", Qwen3ForCausalLM, False),
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM", LlamaForCausalLM, False),
    ({"architectures": ["LlamaForCausalLM"], "attention_bias": True}, "LlamaForCausalLM",
     LlamaForCausalLM, True),
    ({"model_type": "mistral", "sliding_window": None}, "MistralForCausalLM", LlamaForCausalLM,
     False),
])
def test_family_class_and_biases(fields, architecture, cls, bias):
    config = _cfg(**fields)
    assert config.architecture == architecture
    assert get_model_class(config.architecture) is cls
    assert config.attention_bias is bias
    check_supported(config)


def test_unsupported_architectures_are_named_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; jaxllm runs "
                                         + ", ".join(SUPPORTED_ARCHITECTURES)):
        check_supported(_cfg(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        _cfg(model_type="gpt2")


def test_a_sliding_window_keeps_the_whole_context():
    """A window is attention over the window on its layers: the context stays the model's
    positions."""
    windowed = _cfg(model_type="mistral", sliding_window=64)
    check_supported(windowed)
    assert windowed.sliding_window == 64
    assert windowed.layer_sliding_window(0) == 64  # Mistral: every layer
    assert windowed.max_context_len == 256
    # Qwen configs carry a window they do not use unless use_sliding_window says so.
    unused = _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=64)
    assert unused.sliding_window is None and unused.layer_sliding_window(0) is None


def test_split_k_is_sized_by_the_keys_a_query_sees():
    """Every layer sliding: a decode query sees at most the window, whatever max_model_len;
    one full layer: the whole context."""
    every = _cfg(model_type="mistral", sliding_window=64)
    assert [every.max_attended_keys(n) for n in (16, 64, 4096)] == [16, 64, 64]
    mixed = _cfg(architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, sliding_window=64,
                 use_sliding_window=True, max_window_layers=2)
    assert [mixed.layer_sliding_window(i) for i in range(4)] == [None, None, 64, 64]
    assert mixed.max_attended_keys(4096) == 4096
    assert _cfg(model_type="mistral", sliding_window=None).max_attended_keys(300) == 300


def _windows(**kw) -> list[int | None]:
    config = _cfg(**{"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
                     "sliding_window": 8, "use_sliding_window": True, **kw})
    return [config.layer_sliding_window(i) for i in range(4)]


def test_qwen_sliding_layers_are_transformers():
    # Layers from max_window_layers on slide (transformers' default layer_types)...
    assert _windows(max_window_layers=1) == [None, 8, 8, 8]
    assert _windows(max_window_layers=0) == [8, 8, 8, 8]
    # ... none past the last layer: no window at all (the default max_window_layers is 28).
    assert _windows() == [None] * 4
    assert _cfg(architectures=["Qwen2ForCausalLM"], sliding_window=8,
                use_sliding_window=True).sliding_window is None
    # An explicit layer_types wins over max_window_layers; Qwen3 reads the same fields.
    kinds = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert _windows(max_window_layers=0, layer_types=kinds) == [8, None, 8, None]
    assert _windows(architectures=["Qwen3ForCausalLM"], max_window_layers=2) \
        == [None, None, 8, 8]
    # ... and without use_sliding_window, layer_types slides nothing.
    assert _windows(use_sliding_window=False, layer_types=kinds) == [None] * 4
    with pytest.raises(ValueError, match="layer_types names 3 layers, num_hidden_layers is 4"):
        _windows(layer_types=kinds[:3])
    with pytest.raises(ValueError, match="layer_types must list"):
        _windows(layer_types=["chunked_attention"] * 4)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        _windows(sliding_window=0, max_window_layers=0)


def test_gguf_sliding_window_is_every_layers():
    meta = {"general.architecture": "llama", "llama.block_count": 2,
            "llama.embedding_length": 32, "llama.feed_forward_length": 64,
            "llama.attention.head_count": 4, "llama.context_length": 256,
            "llama.attention.sliding_window": 16}
    config = ModelConfig.from_gguf_metadata(meta, vocab_size=64, tied=False)
    assert [config.layer_sliding_window(i) for i in range(2)] == [16, 16]
    del meta["llama.attention.sliding_window"]
    assert ModelConfig.from_gguf_metadata(meta, vocab_size=64, tied=False).sliding_window is None
    # llama.cpp's converter writes a null window as 0 (Phi-4's files).
    phi4 = {k.replace("llama.", "phi3."): v for k, v in meta.items()}
    phi4.update({"general.architecture": "phi3", "phi3.attention.sliding_window": 0})
    assert ModelConfig.from_gguf_metadata(phi4, vocab_size=64, tied=False).sliding_window is None


def test_rope_parameters_in_both_config_forms():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = _cfg(rope_theta=5e5, rope_scaling=llama3)
    new = _cfg(rope_parameters={**llama3, "rope_theta": 5e5})
    assert old == new
    assert old.rope_theta == 5e5
    assert old.rope_scaling == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=64)
    assert _cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e6}).rope_scaling is None
    # yarn without an original length: the model's (as transformers fills it).
    yarn = _cfg(rope_scaling={"type": "yarn", "factor": 4.0}).rope_scaling
    assert yarn is not None and yarn.original_max_position_embeddings == 256
    assert (yarn.beta_fast, yarn.beta_slow) == (32.0, 1.0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope short_factor must be"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs a factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, "rope factor must be"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": "x"}},
     "rope low_freq_factor must be"),
    ({"rope_scaling": "linear"}, "rope parameters must be an object"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
])
def test_what_is_not_supported_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**fields)


def test_every_end_of_generation_token_is_kept(tmp_path):
    config = _cfg(architectures=["LlamaForCausalLM"], eos_token_id=[60, 61])
    assert (config.eos_token_id, config.eos_token_ids) == (60, (60, 61))
    gen = tmp_path / "generation_config.json"
    gen.write_text(json.dumps({"eos_token_id": [61, 62]}))
    assert config.with_generation_config(gen).eos_token_ids == (60, 61, 62)
    assert config.with_generation_config(tmp_path / "absent.json") == config
    gen.write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ValueError, match="eos_token_id must be token ids"):
        config.with_generation_config(gen)


def test_gguf_metadata_of_each_family():
    meta = {"general.architecture": "llama", "llama.embedding_length": 32,
            "llama.feed_forward_length": 64, "llama.block_count": 1,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.context_length": 256, "llama.rope.freq_base": 5e5,
            "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
            "tokenizer.ggml.eos_token_id": 60, "tokenizer.ggml.eot_token_id": 61}
    config = ModelConfig.from_gguf_metadata(meta, 64, tied=True, attention_bias=False)
    assert config.architecture == "LlamaForCausalLM"
    assert config.rope_scaling == RopeScaling("linear", factor=2.0)
    assert config.eos_token_ids == (60, 61)
    qwen3 = {k.replace("llama.", "qwen3."): v for k, v in meta.items()
             if not k.startswith("llama.rope.scaling")}
    qwen3["general.architecture"] = "qwen3"
    qwen3["qwen3.attention.key_length"] = 16
    config = ModelConfig.from_gguf_metadata(qwen3, 64, tied=False, attention_bias=False)
    assert (config.architecture, config.head_dim, config.rope_scaling) == (
        "Qwen3ForCausalLM", 16, None)
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported "
                                         r"\(supported: qwen2, qwen3, llama, phi3, granite, "
                                         r"gemma, gemma2, gemma3, olmo2\)"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gpt2"}, 64, tied=True)


def test_linear_and_yarn_scalings_stretch_the_context():
    """vLLM's reading: YaRN's trained length times its factor, linear's max_position_embeddings
    times its factor; Llama 3's config already names the stretched length."""
    yarn = _cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 256})
    assert yarn.max_context_len == 1024
    assert _cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}).max_context_len == 512
    llama3 = _cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64})
    assert llama3.max_context_len == 256
    assert _cfg().max_context_len == 256
    from jaxllm.model_executor.layers.rotary_embedding import rope_variables

    assert rope_variables(yarn)["cos_sin_cache"].shape == (1024, 8)


def test_a_mistral_config_without_a_window_has_mistrals_default_one():
    # transformers' MistralConfig fills in 4096 when the file names no sliding_window.
    config = _cfg(model_type="mistral", max_position_embeddings=32768)
    assert config.sliding_window == 4096
    assert config.max_context_len == 32768  # the whole context, through the window


@pytest.mark.parametrize("arch, extra", [
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, max_window_layers=3)),
    ("Qwen2MoeForCausalLM", dict(use_sliding_window=False)),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=True)),
    ("Qwen3MoeForCausalLM", dict(use_sliding_window=False)),
    ("MixtralForCausalLM", dict(sliding_window=32)),
    ("MixtralForCausalLM", dict()),
])
def test_mixture_of_experts_windows_follow_transformers(arch, extra):
    """Which layers slide, as transformers' configs and attention modules decide it."""
    transformers = pytest.importorskip("transformers")
    fields = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                  num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  max_position_embeddings=256, **extra)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    hf = config_cls(**{k: v for k, v in fields.items()
                       if k not in ("num_experts", "num_local_experts")
                       or k == ("num_local_experts" if arch.startswith("Mixtral")
                                else "num_experts")})
    layer_types = getattr(hf, "layer_types", None)
    if arch == "Qwen2MoeForCausalLM":
        window = hf.sliding_window if hf.use_sliding_window else None
        want = [window if kind == "sliding_attention" else None for kind in layer_types]
    else:  # Qwen3-MoE and Mixtral: the config's window on every layer
        want = [hf.sliding_window] * 4
    ours = ModelConfig.from_hf_config({**hf.to_dict(), "architectures": [arch]})
    assert [ours.layer_sliding_window(i) for i in range(4)] == want


@pytest.mark.parametrize("arch", ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                                  "MixtralForCausalLM"])
def test_moe_fields_left_out_take_transformers_defaults(arch):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512)
    whole = {**hf.to_dict(), "architectures": [arch]}
    moe_keys = ("num_experts", "num_local_experts", "num_experts_per_tok",
                "moe_intermediate_size", "shared_expert_intermediate_size")
    sparse = {k: v for k, v in whole.items() if k not in moe_keys}
    assert ModelConfig.from_hf_config(sparse).moe == ModelConfig.from_hf_config(whole).moe
    # Either name of the expert count, given alone, wins over the default.
    for key in ("num_experts", "num_local_experts"):
        moe = ModelConfig.from_hf_config({**sparse, key: 9}).moe
        assert moe is not None and moe.num_experts == 9
