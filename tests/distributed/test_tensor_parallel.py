"""Tensor parallelism on virtual CPU devices: TP = 2, 4, 8 against TP = 1.

The sharded engines run in a child process (tp_child.py beside this file), since the virtual
device count must be set before JAX starts; this process compares what it saved. The tiny model
(8 query heads, 4 KV heads) covers several KV heads per device (TP 2), one (TP 4) and replicated
KV heads (TP 8), with an untied LM head; the refusals and the per-shard weight layout run here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxllm.distributed.tensor_parallel import _per_shard_gate_up, _per_shard_qkv, tp_layout
from jaxllm.model_executor.config import ModelConfig
from tests.distributed.tp_child import REAL_ENGINE, REAL_MAX_NEW, REAL_PROMPTS
from tests.utils import save_tiny_checkpoint

SIZES = (1, 2, 4, 8)
CHILD = Path(__file__).with_name("tp_child.py")


def run_child(args: list[str], timeout: float, devices: int = 8) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=str(CHILD.parents[2]))
    proc = subprocess.run([sys.executable, str(CHILD), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_tiny")
    save_tiny_checkpoint(path, tied=False, seed=3, num_attention_heads=8, num_key_value_heads=4)
    out = path / "results.npz"
    run_child([str(path), str(out), ",".join(map(str, SIZES)),
               '{"max_num_seqs": 2, "max_num_batched_tokens": 16}'], timeout=400)
    return dict(np.load(out))


@pytest.fixture(scope="module")
def tp_pallas_results(tmp_path_factory):
    """The Pallas kernels themselves (interpret mode) per device under shard_map: 4 query heads,
    2 KV heads, head_dim 16, TP 1 and 2."""
    path = tmp_path_factory.mktemp("tp_tiny_pallas")
    save_tiny_checkpoint(path, tied=True, seed=5)
    out = path / "results.npz"
    run_child([str(path), str(out), "1,2", '{"max_num_seqs": 2, "max_num_batched_tokens": 16, '
                                          '"kernel_backend": "interpret"}'], timeout=400)
    return dict(np.load(out))


@pytest.fixture(scope="module", params=["qwen3", "llama", "gemma2"])
def tp_family_results(request, tmp_path_factory):
    """TP 1 and 2 over a tiny Qwen3 (per-head q/k norms, head_dim 32), a tiny Llama 3 (scaled
    RoPE; biases on q, k, v and o_proj, the last added once after the sum) and a tiny Gemma 2
    (soft-capped attention and final logits on the vocabulary slices, a windowed layer, scaled
    embeddings, tied): 4 query heads and 2 KV heads, one KV head per device at TP 2."""
    path = tmp_path_factory.mktemp(f"tp_tiny_{request.param}")
    bias = {"attention_bias": True} if request.param == "llama" else {}
    save_tiny_checkpoint(path, tied=request.param == "gemma2", seed=6, arch=request.param,
                         **bias)
    out = path / "results.npz"
    run_child([str(path), str(out), "1,2", '{"max_num_seqs": 2, "max_num_batched_tokens": 16}'],
              timeout=400, devices=2)
    return dict(np.load(out))


def test_other_families_match_tp1(tp_family_results):
    r = tp_family_results
    np.testing.assert_array_equal(r["tp2_tokens"], r["tp1_tokens"])
    np.testing.assert_allclose(r["tp2_logits"], r["tp1_logits"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(r["tp2_prompt_logprobs"], r["tp1_prompt_logprobs"], rtol=0,
                               atol=1e-5)
    assert r["tp2_kv_num_devices"] == 2 and r["tp2_kv_shard_shape"][2] == 1
    assert r["tp2_compiles_after_warmup"] == 0


def test_pallas_kernels_under_shard_map_match_tp1(tp_pallas_results):
    r = tp_pallas_results
    np.testing.assert_array_equal(r["tp2_tokens"], r["tp1_tokens"])
    np.testing.assert_allclose(r["tp2_logits"], r["tp1_logits"], rtol=0, atol=1e-5)
    assert r["tp2_kv_shard_shape"][2] == 1 and r["tp2_compiles_after_warmup"] == 0


@pytest.mark.parametrize("tp", SIZES[1:])
def test_logits_and_greedy_tokens_match_tp1(tp_results, tp):
    r = tp_results
    np.testing.assert_array_equal(r[f"tp{tp}_tokens"], r["tp1_tokens"])
    assert r["tp1_logits"].shape[0] >= 3 * 6  # every step's sampled rows were compared
    np.testing.assert_allclose(r[f"tp{tp}_logits"], r["tp1_logits"], rtol=0, atol=1e-5)
    # Per-shard top-K and log-sum-exp, merged across devices.
    np.testing.assert_allclose(r[f"tp{tp}_topk_values"], r["tp1_topk_values"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(r[f"tp{tp}_topk_ids"], r["tp1_topk_ids"])
    np.testing.assert_allclose(r[f"tp{tp}_topk_lse"], r["tp1_topk_lse"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(r[f"tp{tp}_prompt_logprobs"], r["tp1_prompt_logprobs"], rtol=0,
                               atol=1e-5)


def test_tp1_top_k_is_the_full_logits_top_k(tp_results):
    logits, values = tp_results["tp1_logits"], tp_results["tp1_topk_values"]
    np.testing.assert_allclose(values, -np.sort(-logits, axis=1)[:, :values.shape[1]], atol=0)


@pytest.mark.parametrize("tp", SIZES)
def test_weights_and_kv_are_sharded(tp_results, tp):
    r = {k.removeprefix(f"tp{tp}_"): v for k, v in tp_results.items() if k.startswith(f"tp{tp}_")}
    nh, nkv, hd, hidden, inter, vocab = 8, 4, 8, 64, 128, 512
    kv_local = max(nkv // tp, 1)
    assert r["kv_num_devices"] == tp
    assert r["kv_shape"].tolist() == [2, 2, max(nkv, tp), 64, 16, hd]  # replicas at TP 8
    assert r["kv_shard_shape"].tolist() == [2, 2, kv_local, 64, 16, hd]
    assert r["qkv_proj_shard_shape"].tolist() == [(nh // tp + 2 * kv_local) * hd, hidden]
    assert r["o_proj_shard_shape"].tolist() == [hidden, nh * hd // tp]
    assert r["gate_up_proj_shard_shape"].tolist() == [2 * inter // tp, hidden]
    assert r["down_proj_shard_shape"].tolist() == [hidden, inter // tp]
    assert r["embed_shard_shape"].tolist() == [vocab // tp, hidden]


@pytest.mark.parametrize("tp", SIZES)
def test_no_step_compiles_after_warm_up(tp_results, tp):
    assert tp_results[f"tp{tp}_control_compiles"] >= 1  # the counter does count compiles
    assert tp_results[f"tp{tp}_compiles_after_warmup"] == 0


# --- in process: layout and refusals -----------------------------------------------------------


def _config(nh: int, nkv: int, **kw) -> ModelConfig:
    base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=nh, num_key_value_heads=nkv, head_dim=4)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("nh, nkv, tp", [(8, 4, 2), (8, 4, 4), (8, 2, 8), (14, 2, 2)])
def test_each_device_holds_its_own_q_k_v_heads(nh, nkv, tp):
    cfg = _config(nh, nkv)
    layout = tp_layout(cfg, tp)
    hd = cfg.head_dim
    # Rows labelled kind * 1000 + head, one column: q heads, then k, then v.
    labels = np.concatenate([np.repeat(np.arange(n) + 1000 * kind, hd)
                             for kind, n in ((0, nh), (1, nkv), (2, nkv))])
    for x in (labels, labels[:, None] * np.ones((1, 3), int)):
        shards = np.split(_per_shard_qkv(x, layout), tp)
        for d, shard in enumerate(shards):
            heads = shard[::hd] if shard.ndim == 1 else shard[::hd, 0]
            q_heads = list(range(d * nh // tp, (d + 1) * nh // tp))
            # The KV heads those query heads read (GQA groups of nh // nkv).
            kv_heads = sorted({h * nkv // nh for h in q_heads})
            assert heads.tolist() == q_heads + [1000 + h for h in kv_heads] \
                + [2000 + h for h in kv_heads]
    gate_up = np.concatenate([np.arange(128), 1000 + np.arange(128)])
    for d, shard in enumerate(np.split(_per_shard_gate_up(gate_up, tp), tp)):
        rows = np.arange(d * 128 // tp, (d + 1) * 128 // tp)
        assert shard.tolist() == rows.tolist() + (1000 + rows).tolist()


@pytest.mark.parametrize("nh, nkv, kw, tp, words", [
    (8, 4, {}, 3, ["3", "num_attention_heads 8"]),
    (8, 4, {"intermediate_size": 100}, 8, ["8", "intermediate_size 100"]),
    (8, 4, {"vocab_size": 500}, 8, ["8", "vocab_size 500"]),
    (24, 3, {}, 4, ["4", "num_key_value_heads 3"]),  # more devices than KV heads, not a multiple
    (12, 6, {}, 4, ["4", "num_key_value_heads 6"]),  # fewer, not a divisor
])
def test_a_split_that_cannot_be_made_is_refused_naming_both_numbers(nh, nkv, kw, tp, words):
    with pytest.raises(ValueError) as e:
        tp_layout(_config(nh, nkv, **kw), tp)
    for w in words:
        assert w in str(e.value)


def test_engine_refuses_bad_sizes_at_start_up(tiny_models):
    from jaxllm import LLM

    path = str(tiny_models["tied"][0])  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's "
                                         "num_attention_heads 4"):
        LLM(model=path, tensor_parallel_size=3, skip_tokenizer_init=True, show_progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 devices, 1 are visible"):
        LLM(model=path, tensor_parallel_size=2, skip_tokenizer_init=True, show_progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(model=path, tensor_parallel_size=0, skip_tokenizer_init=True, show_progress=False)


@pytest.mark.real_model
def test_real_model_tp2_greedy_matches_tp1_under_preemption_and_prefix_caching(real_llm,
                                                                              tmp_path):
    # The child holds the 0.5B model sharded over 2 virtual devices; the parent's shared
    # engine (TP = 1, same buckets) is the oracle.
    from jaxllm import SamplingParams

    assert {k: getattr(real_llm.llm_engine.engine_args, k) for k in REAL_ENGINE} == REAL_ENGINE
    out = tmp_path / "real.npz"
    run_child(["--real", str(out), "2"], timeout=400, devices=2)
    r = dict(np.load(out))
    assert r["num_preemptions"] > 0
    assert (r["num_cached_tokens"][:3] > 0).all()  # the shared prefix hit the cache
    sp = SamplingParams(temperature=0, max_tokens=REAL_MAX_NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in real_llm.generate(REAL_PROMPTS[:1] + REAL_PROMPTS, sp,
                                                              use_tqdm=False)]
    np.testing.assert_array_equal(r["tokens"], np.array(want))


# Both weight trees: XLA's (GEMV params beside float32 copies) and the Pallas kernel's (one
# quantized tree).
@pytest.mark.parametrize("backend", [None, "interpret"])
def test_gguf_quantized_params_refuse_tensor_parallelism(tmp_path, backend):
    from jaxllm import LLM
    from tests.gguf_models import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    with pytest.raises(ValueError, match="quantization='gguf' does not run with "
                                         "tensor_parallel_size > 1"):
        LLM(model=str(path), quantization="gguf", tensor_parallel_size=2,
            kernel_backend=backend, skip_tokenizer_init=True, show_progress=False)
