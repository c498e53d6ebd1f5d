"""Builders shared by the tests: tiny random Qwen2 checkpoints (the HF oracle's weights), an
engine over them, and the checks every engine test ends with."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from scheduler import NULL_BLOCK_ID

if TYPE_CHECKING:
    from jaxllm import LLM

# The engine tests' prompt lengths (engine/conftest.py) and generated tokens per prompt.
PROMPT_LENS = [3, 70, 17, 40, 9, 33]
MAX_NEW = 24

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
    code = ("import json, sys; from tests.utils import make_tiny_checkpoint; "
            "make_tiny_checkpoint(sys.argv[1], **json.loads(sys.argv[2]))")
    kwargs = json.dumps({"tied": tied, "seed": seed, **overrides})
    proc = subprocess.run([str(_TORCH_PYTHON), "-c", code, str(path), kwargs],
                          cwd=_TORCH_PYTHON.parents[2], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def make_llm(path, **kw) -> LLM:
    from jaxllm import LLM

    args = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, show_progress=False)
    args.update(kw)
    return LLM(model=str(path), **args)


def assert_pool_free(llm: LLM) -> None:
    core = llm.llm_engine.engine_core_client.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == llm.llm_engine.num_kv_blocks - 1  # block 0 is the null block
    assert not core.scheduler.requests and not llm.llm_engine.output_processor.parents
    assert NULL_BLOCK_ID == 0


def on_each_step(llm: LLM, record) -> None:
    """Call record(scheduler_output) before the runner executes each step."""
    runner = llm.llm_engine.engine_core_client.engine_core.runner
    original = runner.prepare

    def spy(so, *args, **kwargs):
        record(so)
        return original(so, *args, **kwargs)

    runner.prepare = spy
