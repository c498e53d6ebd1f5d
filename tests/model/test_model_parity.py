"""Our Flax Qwen2 + loader against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from tests.model_inputs import prefill_inputs, prefill_logits
from tests.utils import hf_greedy_tokens, kv_budget_kwargs, make_tiny_checkpoint, runner_of

PROMPT_LENS = [1, 5, 16, 23, 40]


def _hf_logits(hf, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].numpy()


def _our_logits(path, prompts, **model_kw) -> list[np.ndarray]:
    return prefill_logits(load_model(path, progress=False), prompts, **model_kw)


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_batch_logits_match_hf(tiny_models, variant, rng):
    path, hf = tiny_models[variant]
    prompts = [rng.integers(0, 512, n).tolist() for n in PROMPT_LENS]
    ours = _our_logits(path, prompts)
    for prompt, got in zip(prompts, ours, strict=True):
        want = _hf_logits(hf, prompt)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_identically(tmp_path, rng):
    hf = make_tiny_checkpoint(tmp_path / "one", tied=False, seed=3)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    prompts = [rng.integers(0, 512, 9).tolist()]
    a = _our_logits(tmp_path / "one", prompts)[0]
    b = _our_logits(tmp_path / "sharded", prompts)[0]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, _hf_logits(hf, prompts[0]), atol=1e-4, rtol=0)


def test_rope_theta_and_odd_heads_follow_config(tmp_path, rng):
    # 7 query heads per KV head (as in Qwen2.5-0.5B) and a large rope_theta.
    hf = make_tiny_checkpoint(tmp_path, tied=True, seed=4, num_attention_heads=14,
                              num_key_value_heads=2, hidden_size=112, rope_theta=1e6)
    prompt = rng.integers(0, 512, 33).tolist()
    got = _our_logits(tmp_path, [prompt])[0]
    np.testing.assert_allclose(got, _hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_bfloat16_model_is_close_to_float32(tiny_models, rng):
    path, hf = tiny_models["untied"]
    prompt = rng.integers(0, 512, 12).tolist()
    loaded = load_model(path, dtype=jnp.bfloat16, progress=False)
    assert all(x.dtype == jnp.bfloat16 for x in __import__("jax").tree.leaves(loaded.params))
    model = Qwen2ForCausalLM(loaded.config, dtype=jnp.bfloat16)
    ids, pos, kv, md = prefill_inputs(loaded.config, [prompt], dtype=jnp.bfloat16)
    logits, _, _ = model.apply({"params": loaded.params, "rope": rope_variables(loaded.config)},
                            ids, pos, kv, md)
    # bfloat16 keeps 8 mantissa bits: ~0.4% relative per op, so compare loosely.
    want = _hf_logits(hf, prompt)
    np.testing.assert_allclose(np.asarray(logits), want, atol=0.05 * np.abs(want).max(), rtol=0)


def test_bfloat16_on_cpu_runs_gemvs_on_float32_copies(tiny_models, rng):
    """dtype bfloat16 on CPU: decode buckets under 16 rows get float32 copies of the bfloat16
    weights (no bf16 GEMVs), token buckets the bfloat16 weights, the KV cache is float32; not
    bit-identical to either the float32 model or an all-bf16 step, so compared loosely."""
    import jax

    path, hf = tiny_models["untied"]
    # In process: the test reads the runner's weight trees and model.
    llm = LLM(model=str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=16, show_progress=False,
              multiprocess_mode=False, **kv_budget_kwargs())
    runner = runner_of(llm)
    small, big = runner.params_for(2, 1), runner.params_for(16, 16)
    assert runner.params_for(1, 1) is small and runner.params_for(8, 1) is small
    for key in ("embed_tokens", "lm_head"):
        assert small[key].dtype == jnp.float32 and big[key].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(small[key].astype(jnp.bfloat16)),
                                      np.asarray(big[key]))
    assert small["layers_1"]["mlp"]["down_proj"]["weight"].dtype == jnp.float32
    assert small["norm"]["weight"] is big["norm"]["weight"]  # vectors shared, not copied
    # XLA on CPU would convert a 16-bit KV array to float32 and back around every write.
    assert runner.kv_cache.dtype == jnp.float32
    prompts = [rng.integers(0, 512, 5).tolist(), rng.integers(0, 512, 9).tolist()]
    # The runner's model: float32 hidden states (activation_dtype), bf16 only into the GEMMs.
    model = runner.model
    assert runner.activation_dtype == jnp.float32 and model.dtype == jnp.bfloat16
    ids, pos, kv, md = prefill_inputs(runner.config, prompts, dtype=jnp.float32)
    variables = {"rope": rope_variables(runner.config)}
    got = {}
    for name, tree in (("gemv", small), ("gemm", big)):
        logits, hidden, _ = jax.jit(model.apply)({**variables, "params": tree}, ids, pos, kv, md)
        assert hidden.dtype == jnp.float32
        got[name] = np.asarray(logits)
    want = np.concatenate([_hf_logits(hf, p) for p in prompts])
    for logits in got.values():
        np.testing.assert_allclose(logits, want, atol=0.05 * np.abs(want).max(), rtol=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert runner.step_shape_counts[(2, 1)] == 3  # the decode steps ran the float32 GEMVs


@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_greedy_generate_matches_hf(tiny_models, variant, rng):
    path, hf = tiny_models[variant]
    llm = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=256, dtype="float32",
              **kv_budget_kwargs())
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf_greedy_tokens(hf, list(prompt), 20)
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"
