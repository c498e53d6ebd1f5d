"""Mixture-of-experts families against Hugging Face transformers on tiny random checkpoints
(float32, 8 experts, top 2, hidden 64): Qwen2-MoE (a shared expert behind a sigmoid gate,
`norm_topk_prob` false, layer 1 in `mlp_only_layers` so it stays dense), Qwen3-MoE
(`norm_topk_prob`, per-head q/k norms) and Mixtral (renormalized top-k, `block_sparse_moe`
names on disk). Logits with the reference and interpret-mode Pallas kernels, both ways of
computing the experts (one token: the per-pair path; a prompt batch: the grouped path), greedy
tokens through LLM with chunked prefill, the stacked-experts layout on disk, tensor parallelism
against one device, and the refusals.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import SamplingParams
from jaxllm.model_executor.config import ModelConfig
from jaxllm.model_executor.layers.fused_moe import expert_method, fused_experts, route
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from tests.gguf_models import write_skeleton_gguf
from tests.model_inputs import prefill_logits
from tests.utils import (
    hf_greedy_tokens,
    hf_prompt_logits,
    make_llm,
    random_prompts,
    tiny_checkpoints,
)

FAMILIES = {
    "qwen2_moe": dict(arch="qwen2_moe", tied=False, seed=31, num_hidden_layers=3,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="qwen3_moe", tied=False, seed=32),
    "mixtral": dict(arch="mixtral", tied=True, seed=33),
}
ARCHITECTURE = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "mixtral": "MixtralForCausalLM"}
MAX_NEW = 8
TP_CHILD = Path(__file__).parents[1] / "distributed" / "tp_child.py"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, FAMILIES)


@pytest.fixture(scope="module")
def loaded(family):
    return functools.cache(lambda name: load_model(family(name)[0], progress=False))


def test_tiny_moe_checkpoints_exercise_their_features(family):
    """The oracle's side: experts stored per expert on disk, dense and sparse layers where the
    config puts them, a shared expert and its gate, routing that renormalization changes."""
    from safetensors import safe_open

    path, qwen2 = family("qwen2_moe")
    layers = qwen2.model.layers
    assert hasattr(layers[0].mlp, "experts") and hasattr(layers[2].mlp, "experts")
    assert not hasattr(layers[1].mlp, "experts")
    assert layers[0].mlp.shared_expert_gate.weight.abs().min() > 0
    assert not qwen2.config.norm_topk_prob
    with safe_open(path / "model.safetensors", "np") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names
    path, mixtral = family("mixtral")
    with safe_open(path / "model.safetensors", "np") as f:
        assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in set(f.keys())
    # Routing that is neither uniform nor one-hot: the top-2 probabilities sum well below 1.
    x = torch.randn(16, 64)
    probs = torch.softmax(qwen2.model.layers[0].mlp.gate.weight.detach() @ x.T, dim=0)
    top2 = probs.topk(2, dim=0).values.sum(0)
    assert (top2 < 0.95).all() and (top2 > 0.3).all() and top2.std() > 0.02


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_reads_the_moe_fields(loaded, name):
    moe = loaded(name).config.moe
    assert loaded(name).config.architecture == ARCHITECTURE[name]
    assert moe is not None and (moe.num_experts, moe.top_k) == (8, 2)
    want = {"qwen2_moe": ((0, 2), False, 48, 32), "qwen3_moe": ((0, 1), True, 0, 32),
            "mixtral": ((0, 1), True, 0, 48)}[name]
    assert (moe.sparse_layers, moe.renormalize, moe.shared_expert_intermediate_size,
            moe.intermediate_size) == want


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_hf(family, loaded, name):
    """One token alone takes the per-pair path, a batch of prompts the grouped one."""
    _, hf = family(name)
    single, batch = random_prompts(1, [1]), random_prompts(2, [9, 100])
    moe = loaded(name).config.moe
    assert expert_method(1, moe.top_k, moe.num_experts) == "gather"
    assert expert_method(109, moe.top_k, moe.num_experts) == "grouped"
    for backend in ("reference", "interpret"):
        for prompts in (single, batch):
            got = prefill_logits(loaded(name), prompts, kernel_backend=backend)
            for prompt, g in zip(prompts, got, strict=True):
                np.testing.assert_allclose(g, hf_prompt_logits(hf, prompt), atol=1e-4, rtol=0,
                                           err_msg=f"{name}, {backend}, {len(prompt)} tokens")


def test_expert_paths_agree_with_a_per_token_loop():
    """Both expert paths against a plain loop over tokens and their experts, at token counts
    where the grouped path pads groups, skips tiles, and where every expert is idle but one."""
    rng = np.random.default_rng(0)
    e, k, h, inter = 8, 3, 16, 8
    w_gu = jnp.asarray(rng.standard_normal((e, 2 * inter, h), np.float32))
    w_down = jnp.asarray(rng.standard_normal((e, h, inter), np.float32))
    for t in (1, 5, 40):
        x = jnp.asarray(rng.standard_normal((t, h), np.float32))
        weights, ids = route(jnp.asarray(rng.standard_normal((t, e), np.float32)), k, True)
        want = np.zeros((t, h), np.float32)
        for i in range(t):
            for j in range(k):
                ex = int(ids[i, j])
                g, u = np.split(np.asarray(w_gu[ex]) @ np.asarray(x[i]), 2)
                act = g / (1 + np.exp(-g)) * u
                want[i] += float(weights[i, j]) * (np.asarray(w_down[ex]) @ act)
        for method in ("gather", "grouped"):
            got = jax.jit(functools.partial(fused_experts, method=method))(
                x, w_gu, w_down, weights, ids)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{method}, {t}")
    # Every pair on one expert: one group of many tiles.
    x = jnp.ones((20, h), jnp.float32)
    ids = jnp.zeros((20, k), jnp.int32).at[:, 1:].set(jnp.arange(1, k))
    weights = jnp.full((20, k), 1.0 / k, jnp.float32)
    np.testing.assert_allclose(fused_experts(x, w_gu, w_down, weights, ids, "grouped"),
                               fused_experts(x, w_gu, w_down, weights, ids, "gather"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generate_matches_hf(family, name):
    """Decode steps of 1 and 2 tokens take the per-pair path, the 16-token chunks of the prefills
    (chunked: a 16-token step budget) the grouped one."""
    path, hf = family(name)
    llm = make_llm(path, dtype="float32", max_model_len=256, max_num_batched_tokens=16,
                   max_num_seqs=2)
    prompts = random_prompts(3, [5, 70])
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, MAX_NEW), \
            f"{name}, prompt of {len(prompt)} tokens"
    llm.shutdown()


def _rewrite_tensors(src, dst, edit) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_stacked_experts_on_disk_load_too(family, loaded, tmp_path):
    """transformers 5's in-memory layout written as is (`mlp.experts.gate_up_proj` [E, 2 inter,
    hidden], `down_proj`): the same params as the per-expert files give."""
    src, _ = family("qwen3_moe")

    def stack(tensors):
        for i in range(2):
            p = f"model.layers.{i}.mlp.experts."
            tensors[p + "gate_up_proj"] = np.stack([np.concatenate(
                [tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
                for e in range(8)])
            tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{e}.down_proj.weight")
                                                for e in range(8)])

    _rewrite_tensors(src, tmp_path / "stacked", stack)
    got = load_model(tmp_path / "stacked", progress=False).params
    want = loaded("qwen3_moe").params
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 got, want)


def test_an_expert_the_config_lacks_is_refused_by_name(family, tmp_path):
    src, _ = family("mixtral")

    def extra(tensors):
        tensors["model.layers.0.block_sparse_moe.experts.8.w1.weight"] = \
            tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"]

    _rewrite_tensors(src, tmp_path / "extra", extra)
    with pytest.raises(ModelLoadError, match=r"experts\.8\.w1"):
        load_model(tmp_path / "extra", progress=False)


def test_tensor_parallel_2_matches_one_device(family, tmp_path):
    """Qwen2-MoE (shared expert, a dense layer) at TP 2 on two virtual CPU devices (in a child
    process: the device count is fixed when JAX starts): each expert's intermediate dimension
    split, routed and shared outputs summed by one all-reduce; every step's logits and the
    greedy tokens as on one device, the stacked experts sharded."""
    path, _ = family("qwen2_moe")
    out = tmp_path / "tp.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(TP_CHILD.parents[2]),
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(TP_CHILD), str(path), str(out), "1,2",
                           '{"max_num_seqs": 2, "max_num_batched_tokens": 16}'],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = dict(np.load(out))
    np.testing.assert_array_equal(r["tp2_tokens"], r["tp1_tokens"])
    np.testing.assert_allclose(r["tp2_logits"], r["tp1_logits"], rtol=0, atol=1e-5)
    assert r["tp2_experts_gate_up_shard_shape"].tolist() == [8, 32, 64]
    assert r["tp2_experts_down_shard_shape"].tolist() == [8, 64, 16]


# --- refusals ----------------------------------------------------------------------------------


def _config(name_family: str, **changes) -> dict:
    base = {"qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8,
                          "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
            "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                        "sliding_window": None}}[name_family]
    cfg = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, **base)
    cfg.update(changes)
    return cfg


def test_moe_configs_refused_by_name():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_config(_config("qwen2_moe", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_config(_config("mixtral", hidden_act="gelu"))
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelConfig.from_hf_config(_config("qwen2_moe", decoder_sparse_step=0))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf_config(_config("qwen2_moe", moe_intermediate_size=None))
    # As transformers places them: every second layer sparse, none where all are listed dense.
    assert ModelConfig.from_hf_config(
        _config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2)).moe.sparse_layers \
        == (1, 3)
    assert ModelConfig.from_hf_config(
        _config("qwen2_moe", mlp_only_layers=[0, 1])).moe.sparse_layers == ()
    assert ModelConfig.from_hf_config(_config("qwen2_moe", num_experts=0)).moe is None


def test_tensor_parallel_size_must_divide_the_expert_width():
    from jaxllm.distributed.tensor_parallel import tp_layout

    cfg = ModelConfig.from_hf_config(_config("qwen2_moe", moe_intermediate_size=33))
    with pytest.raises(ValueError, match="moe_intermediate_size 33"):
        tp_layout(cfg, 2)
    local = tp_layout(ModelConfig.from_hf_config(_config("qwen2_moe")), 2).local.moe
    assert local is not None
    assert (local.intermediate_size, local.shared_expert_intermediate_size) == (16, 24)


@pytest.mark.parametrize("arch, expert_key", [("qwen2moe", None), ("qwen3moe", None),
                                              ("llama", "llama.expert_count")])
def test_moe_gguf_is_refused_by_name(tmp_path, arch, expert_key):
    path = tmp_path / f"{arch}.gguf"
    write_skeleton_gguf(path, arch, {expert_key: 8} if expert_key else None)
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    message = str(e.value).replace(str(path), "")
    assert arch in message and "experts" in message, message
