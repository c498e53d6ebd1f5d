"""Builders shared by the tests: tiny random checkpoints of each supported family (the HF
oracle's weights), an engine over them, and the checks every engine test ends with."""

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

# Llama 3's RoPE scaling stretched over a tiny model: with an original length of 64 (and
# wavelengths 2 pi / theta^(2i/d) from ~6 to ~40,000 tokens for head_dim 16) every band of it is
# hit: frequencies kept, divided by the factor, and smoothly in between.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# The families make_tiny_checkpoint writes: a transformers config class and its defaults beyond
# TINY_KW (Qwen3: head_dim 32, not hidden_size / num_attention_heads = 16; Llama: Llama 3's
# scaled RoPE; Mistral: no sliding window, which is the one form jaxllm runs).
TINY_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "llama": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    # Mixtures of experts: 8 experts, top 2, each expert narrower than the dense MLP.
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                  "intermediate_size": 48, "sliding_window": None}),
    # Phi3Config's pad and end ids (32000) lie outside a tiny vocabulary.
    "phi3": ("Phi3Config", {"pad_token_id": 0, "eos_token_id": 2}),
    "granite": ("GraniteConfig", {}),
    # Olmo2Config's end id (50279) lies outside a tiny vocabulary.
    "olmo2": ("Olmo2Config", {"pad_token_id": 0, "eos_token_id": 2}),
    # Gemma: head_dim 32 (hidden / heads is 16). Gemma 2: q.k scaled by 24 ** -0.5, a window
    # of 20 on layer 0, soft caps that weights ten times transformers' initialization reach.
    # Gemma 3 (text): layers 0 and 1 slide (one global layer in three), the sliding layers'
    # RoPE base 100, the global layer's 10000 stretched linearly by 2; weights five times
    # transformers' initialization (ten: float32 rounding alone nears the tolerance at 150
    # tokens, in transformers' float32 model as in ours).
    "gemma": ("GemmaConfig", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", {"head_dim": 32, "query_pre_attn_scalar": 24,
                                "sliding_window": 20, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 5.0, "initializer_range": 0.1}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 20,
        "num_hidden_layers": 3, "sliding_window_pattern": 3, "initializer_range": 0.05,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 100.0}}}),
}


def make_tiny_checkpoint(path, tied: bool, vocab_size: int = 512, seed: int = 0,
                         arch="qwen2", **overrides):
    """Save a random HF model with save_pretrained (safetensors); returns the HF model.

    `arch`: a TINY_FAMILIES name ("qwen2", the default; "qwen3", "llama", "mistral") or a
    transformers config class. `overrides` go to the config over TINY_KW and the family's own
    defaults (`rope_scaling={...}` or `rope_parameters={...}`: either spelling; None removes a
    family default). Qwen2's q/k/v biases are drawn away from zero; every other family's RMSNorm
    weights (Qwen3's per-head q/k norms included) away from one, and MoE routers wider than
    transformers' initialization, so that each counts."""
    torch = pytest.importorskip(
        "torch", reason="torch (the Hugging Face oracle) is not installed in this test lane")
    import transformers

    torch.manual_seed(seed)
    if isinstance(arch, str):
        if arch not in TINY_FAMILIES:
            raise ValueError(f"unknown tiny family {arch!r} (known: {', '.join(TINY_FAMILIES)})")
        config_name, family_kw = TINY_FAMILIES[arch]
        config_cls = getattr(transformers, config_name)
    else:
        config_cls, family_kw = arch, {}
    kw = {**TINY_KW, **family_kw, **overrides}
    # transformers 5 spells RoPE's parameters `rope_parameters` (rope_theta inside them) and
    # still takes the older `rope_scaling`: one of them, theta included (Gemma 3's are keyed by
    # layer type, each with its own theta).
    rope = kw.pop("rope_parameters", None) or kw.pop("rope_scaling", None)
    kw.pop("rope_scaling", None)
    if rope is not None:
        theta = kw.pop("rope_theta")
        kw["rope_parameters"] = rope if "full_attention" in rope else {"rope_theta": theta,
                                                                        **rope}
    config = config_cls(vocab_size=vocab_size, tie_word_embeddings=tied, **kw)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.config.tie_word_embeddings == tied
    with torch.no_grad():
        if config.model_type == "qwen2":
            # Random init leaves the q/k/v biases at zero; make them count.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        else:
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):  # input/post-attention/final, q_norm, k_norm
                    param.normal_(1.0, 0.3)
                elif name.endswith(".bias"):
                    param.normal_(0, 0.5)
                elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    # MoE routers and shared-expert gates: logits far enough apart that which
                    # experts are picked, and by how much, matter.
                    param.normal_(0, 0.15)
    model.save_pretrained(path)
    return model


def hf_greedy_tokens(model, prompt: list[int], max_new: int) -> list[int]:
    """Hugging Face's greedy continuation of `prompt`: one full forward per token (no cache, no
    generation config), so no token of the prompt is taken for padding and no end-of-sequence
    token is held back, as the engine runs with `ignore_eos`."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def hf_cached_logits_and_greedy(model, prompt: list[int], max_new: int, first: int):
    """Hugging Face run step by step with its KV cache: the first `first` prompt tokens in one
    forward, each later token (of the prompt, then the greedy ones) in a forward of its own.
    Returns (the prompt's logits [len(prompt), vocab] numpy, the `max_new` greedy tokens).
    What a model whose RoPE depends on the length of each forward (longrope) computes for the
    positions of a step-by-step decode."""
    import numpy as np
    import torch
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    logits, tokens = [], []
    with torch.no_grad():
        chunks = [prompt[:first]] + [[t] for t in prompt[first:]]
        for chunk in chunks:
            logits.append(model(torch.tensor([chunk]), cache=cache, use_cache=True).logits[0])
        for _ in range(max_new):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(model(torch.tensor([tokens[-1:]]), cache=cache,
                                use_cache=True).logits[0])
    return np.concatenate([x.numpy() for x in logits])[:len(prompt)], tokens


# The first lane's interpreter (Python 3.11, with torch): a lane without torch writes its tiny
# checkpoints with it.
_TORCH_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"


def random_prompts(seed: int, lens, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of these lengths, drawn from a tiny checkpoint's vocabulary."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def hf_prompt_logits(model, prompt: list[int]):
    """Hugging Face's logits [len(prompt), vocab] (numpy) of one prompt, one forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def tiny_checkpoints(tmp_path_factory, families: dict[str, dict]):
    """name -> (checkpoint path, HF model), each written by make_tiny_checkpoint with
    `families[name]` when first asked for (a module fixture's body)."""
    import functools

    @functools.cache
    def build(name: str):
        path = tmp_path_factory.mktemp(name)
        return path, make_tiny_checkpoint(path, **families[name])

    return build


def save_tiny_checkpoint(path, tied: bool, seed: int = 0, arch: str = "qwen2",
                         **overrides) -> None:
    """`make_tiny_checkpoint` for tests that need only its files (their oracle is not HF): in a
    child process of the first lane's interpreter when this one has no torch (`arch` then a
    TINY_FAMILIES name, `overrides` JSON values)."""
    if importlib.util.find_spec("torch") is not None:
        make_tiny_checkpoint(path, tied, seed=seed, arch=arch, **overrides)
        return
    if not _TORCH_PYTHON.exists():
        pytest.skip(f"no torch here and no {_TORCH_PYTHON} to write the HF checkpoint with")
    code = ("import json, sys; from tests.utils import make_tiny_checkpoint; "
            "make_tiny_checkpoint(sys.argv[1], **json.loads(sys.argv[2]))")
    kwargs = json.dumps({"tied": tied, "seed": seed, "arch": arch, **overrides})
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


# --- embeddings ----------------------------------------------------------------------------------

def hf_pooled(model, prompt: list[int], pooling_type: str = "LAST", normalize: bool = True,
              dimensions: int | None = None):
    """The HF oracle of a pooling runner: the prompt's final-normed hidden states (the last
    entry of `output_hidden_states`, after the model's final norm) pooled by `pooling_type`,
    truncated to `dimensions`, L2-normalized; float64 numpy."""
    import numpy as np
    import torch

    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    rows = hidden.double().numpy()
    vec = {"LAST": rows[-1], "CLS": rows[0], "MEAN": rows.mean(axis=0)}[pooling_type]
    if dimensions is not None:
        vec = vec[:dimensions]
    return vec / np.linalg.norm(vec) if normalize else vec
