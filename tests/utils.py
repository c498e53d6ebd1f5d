"""Builders shared by the tests: tiny random Qwen2 checkpoints (the HF oracle's weights), an
engine over them, and the checks every engine test ends with."""

from __future__ import annotations

import importlib.util
import json
import os
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


# Test engines' KV blocks: on an 80 GB GPU the memory budget would give the tiny test models
# millions of blocks (slow to allocate and zero, and no test needs them), so a GPU gets
# GPU_TEST_KV_BLOCKS unless the variable says otherwise; on CPU, unset, each engine sizes its KV
# as the platform does.
KV_BLOCKS_ENV = "JAXLLM_TEST_KV_BLOCKS"
GPU_TEST_KV_BLOCKS = 2048


def kv_budget_kwargs() -> dict[str, int]:
    """{"num_kv_blocks": N} from $JAXLLM_TEST_KV_BLOCKS; when it is unset or empty,
    GPU_TEST_KV_BLOCKS on a GPU platform and {} on CPU."""
    from jaxllm.config import gpu_platform_installed

    value = os.environ.get(KV_BLOCKS_ENV, "").strip()
    if not value:
        return {"num_kv_blocks": GPU_TEST_KV_BLOCKS} if gpu_platform_installed() else {}
    try:
        blocks = int(value)
    except ValueError:
        blocks = 0
    if blocks < 2:
        raise ValueError(f"{KV_BLOCKS_ENV} must be an integer >= 2 (the null block and one "
                         f"usable one), got {value!r}")
    return {"num_kv_blocks": blocks}


def make_llm(path, **kw) -> LLM:
    """An engine over a tiny checkpoint; `kw` overrides the defaults (num_kv_blocks included:
    $JAXLLM_TEST_KV_BLOCKS applies only where a test gives none)."""
    from jaxllm import LLM

    args = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, show_progress=False, **kv_budget_kwargs())
    args.update(kw)
    return LLM(model=str(path), **args)


# --- the engine core and model runner, through utility calls (either engine mode) ---------------

def scheduler_state(llm: LLM) -> dict[str, int]:
    """The core's `get_scheduler_state()`: free/usable KV blocks, requests, preemptions."""
    return llm.llm_engine.engine_core_client.call_utility("get_scheduler_state")


def compile_count(llm: LLM) -> int:
    """XLA compilations so far in the process that holds the engine's model runner."""
    return llm.collective_rpc("get_compile_count")


def assert_pool_free(llm: LLM) -> None:
    state = scheduler_state(llm)
    # Block 0 is the null block: every other one is free once no request holds any.
    assert NULL_BLOCK_ID == 0
    assert state["num_usable_blocks"] == llm.llm_engine.num_kv_blocks - 1
    assert state["num_free_blocks"] == state["num_usable_blocks"], state
    assert state["num_requests"] == state["num_waiting_reqs"] == state["num_running_reqs"] == 0
    assert not llm.llm_engine.output_processor.parents


# --- in-process internals: only for tests that pin multiprocess_mode=False --------------------

def core_of(llm: LLM):
    """The EngineCore object of an in-process engine (tests of its internals)."""
    from jaxllm.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core_client
    if not isinstance(client, InprocClient):
        raise TypeError(f"this test reads the engine core's internals, which live in another "
                        f"process with {type(client).__name__}: build the LLM with "
                        f"multiprocess_mode=False")
    return client.engine_core


def runner_of(llm: LLM):
    """The ModelRunner object of an in-process engine (tests of its internals)."""
    return core_of(llm).runner


def on_each_step(llm: LLM, record) -> None:
    """Call record(scheduler_output) before the runner executes each step (in-process only)."""
    runner = runner_of(llm)
    original = runner.prepare

    def spy(so, *args, **kwargs):
        record(so)
        return original(so, *args, **kwargs)

    runner.prepare = spy


# --- logprob parity ------------------------------------------------------------------------------

def check_logprobs_close(outputs_a: list[tuple[list[int], list[dict]]],
                         outputs_b: list[tuple[list[int], list[dict]]], *,
                         name_a: str = "a", name_b: str = "b") -> None:
    """Greedy outputs of two implementations that may differ in precision (vLLM's
    check_logprobs_close): each output is (token ids, one {token id: logprob} dict per token,
    holding that step's top-k). Walking each pair of sequences, where the tokens first differ
    each side's token must be among the other side's top-k at that step (a near tie, not a
    wrong model); the rest of the pair is not compared (their contexts differ from there)."""
    assert len(outputs_a) == len(outputs_b), (len(outputs_a), len(outputs_b))
    for i, ((tokens_a, lps_a), (tokens_b, lps_b)) in enumerate(
            zip(outputs_a, outputs_b, strict=True)):
        assert len(tokens_a) == len(lps_a) and len(tokens_b) == len(lps_b), \
            f"sequence {i}: one logprobs dict per token expected"
        for j, (tok_a, tok_b) in enumerate(zip(tokens_a, tokens_b, strict=False)):
            if tok_a == tok_b:
                continue
            where = f"sequence {i}, token {j}: {name_a}={tok_a}, {name_b}={tok_b}"
            assert tok_a in lps_b[j], f"{where}: {name_a}'s token not in {name_b}'s top-k " \
                                      f"{sorted(lps_b[j])}"
            assert tok_b in lps_a[j], f"{where}: {name_b}'s token not in {name_a}'s top-k " \
                                      f"{sorted(lps_a[j])}"
            break
        else:
            assert len(tokens_a) == len(tokens_b), \
                f"sequence {i}: {len(tokens_a)} tokens from {name_a}, {len(tokens_b)} from {name_b}"
