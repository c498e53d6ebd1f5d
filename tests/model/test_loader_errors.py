"""A missing, truncated or foreign checkpoint fails with the path and the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxllm.model_executor.model_loader import default_model
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from tests.utils import save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_err")
    save_tiny_checkpoint(path, tied=False)
    return path


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope")


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_directory_without_weights(tiny_dir, tmp_path):
    d = tmp_path / "cfg_only"
    d.mkdir()
    shutil.copy(tiny_dir / "config.json", d)
    with pytest.raises(ModelLoadError, match=r"cfg_only.*no \*\.safetensors"):
        load_model(d)


def test_truncated_safetensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "trunc")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(d)


def test_config_disagrees_with_weights(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "wrongcfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp.*has shape"):
        load_model(d)


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "fewer_layers")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"missing tensor layers\.2\."):
        load_model(d)


def test_weights_without_a_place_are_named(tiny_dir, tmp_path):
    """A checkpoint with more weights than its config describes (one layer fewer configured;
    an extra tensor) is refused naming them; RoPE's saved buffers are not weights."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_dir, tmp_path / "more_layers")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] -= 1
    (d / "config.json").write_text(json.dumps(cfg))
    last = cfg["num_hidden_layers"]
    with pytest.raises(ModelLoadError, match=rf"has no place for: layers\.{last}\.input_layernorm"
                                             rf"\.weight, .* and \d+ more"):
        load_model(d)
    d = _copy(tiny_dir, tmp_path / "buffers")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, d / "model.safetensors")
    load_model(d, progress=False)
    # Mistral's own copy of the weights beside the Hugging Face one is not read.
    save_file({"layers.0.attention.wq.weight": np.ones(8, np.float32)},
              d / "consolidated.safetensors")
    load_model(d, progress=False)
    tensors["model.extra.weight"] = np.ones(8, np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"has no place for: extra\.weight$"):
        load_model(d, progress=False)


def test_attention_bias_without_o_proj_biases_loads_as_zero_biases(tmp_path):
    """A Llama checkpoint whose config says attention_bias but which holds q/k/v biases only
    (a conversion): as transformers, the absent o_proj biases are zeros."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tests.model_inputs import prefill_logits

    save_tiny_checkpoint(tmp_path / "full", tied=False, seed=16, arch="llama",
                         attention_bias=True)
    tensors = load_file(tmp_path / "full" / "model.safetensors")
    zero = {k: np.zeros_like(v) if k.endswith("o_proj.bias") else v for k, v in tensors.items()}
    save_file(zero, tmp_path / "full" / "model.safetensors")
    stripped = _copy(tmp_path / "full", tmp_path / "stripped")
    save_file({k: v for k, v in tensors.items() if not k.endswith("o_proj.bias")},
              stripped / "model.safetensors")
    full, loaded = load_model(tmp_path / "full"), load_model(stripped)
    assert full.config.o_proj_bias and not loaded.config.o_proj_bias
    prompt = [list(range(3, 30))]
    np.testing.assert_array_equal(prefill_logits(loaded, prompt, kernel_backend="reference")[0],
                                  prefill_logits(full, prompt, kernel_backend="reference")[0])


def test_foreign_architecture_is_named_with_the_supported_ones(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path / "gpt2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel' is not supported.*"
                                             r"Qwen2ForCausalLM.*LlamaForCausalLM"):
        load_model(d)
    del cfg["architectures"]
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(d)


def test_foreign_file_is_not_gguf(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a GGUF file"):
        load_model(f)


@pytest.mark.real_model
def test_truncated_gguf(real_model_path, tmp_path):
    f = tmp_path / "cut.gguf"
    with open(real_model_path, "rb") as src:
        f.write_bytes(src.read(50_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: truncated or corrupt"):
        load_model(f)


def test_default_model_sha_mismatch_refused(tmp_path, monkeypatch):
    parts = []
    for i in range(6):
        p = tmp_path / f"part{i}.bin"
        p.write_bytes(bytes([i]) * 1000)
        parts.append(p)
    monkeypatch.setenv(default_model.CACHE_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_part_paths", lambda: parts)
    with pytest.raises(RuntimeError, match="sha256"):
        default_model.default_model_path()
    # The bad file is not left behind to be trusted next time.
    assert not (tmp_path / "cache" / "models" / default_model.DEFAULT_GGUF_FILENAME).exists()


def test_default_model_verified_and_reused(real_model_path):
    assert real_model_path.stat().st_size == default_model.DEFAULT_GGUF_SIZE
    assert default_model.sha256_of(real_model_path) == default_model.DEFAULT_GGUF_SHA256
    assert default_model.default_model_path() == real_model_path
