"""Shared fixtures: tiny random Qwen2 checkpoints (HF oracle) and the real embedded model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pallas_kernels.common import TRITON_DEPRECATION_FILTER


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", TRITON_DEPRECATION_FILTER)

TINY_KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)


def make_tiny_checkpoint(path, tied: bool, vocab_size: int = 512, seed: int = 0, **overrides):
    """Save a random HF Qwen2 model with save_pretrained (safetensors); returns the HF model."""
    torch = pytest.importorskip(
        "torch", reason="torch (the Hugging Face oracle) is not installed in this test lane")
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=vocab_size, tie_word_embeddings=tied,
                                      **{**TINY_KW, **overrides})
    model = transformers.Qwen2ForCausalLM(config).eval()
    # Random init leaves the q/k/v biases at zero; make them count.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


# The first lane's interpreter (Python 3.11, with torch): a lane without torch writes its tiny
# checkpoints with it.
_TORCH_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"


def save_tiny_checkpoint(path, tied: bool, seed: int = 0, **overrides) -> None:
    """`make_tiny_checkpoint` for tests that need only its files (their oracle is not HF): in a
    child process of the first lane's interpreter when this one has no torch."""
    if importlib.util.find_spec("torch") is not None:
        make_tiny_checkpoint(path, tied, seed=seed, **overrides)
        return
    if not _TORCH_PYTHON.exists():
        pytest.skip(f"no torch here and no {_TORCH_PYTHON} to write the HF checkpoint with")
    code = ("import json, sys; from tests.conftest import make_tiny_checkpoint; "
            "make_tiny_checkpoint(sys.argv[1], **json.loads(sys.argv[2]))")
    kwargs = json.dumps({"tied": tied, "seed": seed, **overrides})
    proc = subprocess.run([str(_TORCH_PYTHON), "-c", code, str(path), kwargs],
                          cwd=_TORCH_PYTHON.parents[2], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"tied": (path, hf_model), "untied": (path, hf_model)}."""
    out = {}
    for name, tied in (("tied", True), ("untied", False)):
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        out[name] = (path, make_tiny_checkpoint(path, tied, seed=1 if tied else 2))
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def real_model_path():
    from jaxllm.model_executor.model_loader.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def real_llm(real_model_path):
    from jaxllm import LLM

    # Small buckets keep start-up (ahead-of-time compilation of every bucket) short.
    return LLM(model=str(real_model_path), max_num_seqs=4, max_num_batched_tokens=64,
               show_progress=False)


@pytest.fixture(scope="session")
def hf_real_model(real_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(real_model_path.parent), gguf_file=real_model_path.name, dtype=torch.float32).eval()
