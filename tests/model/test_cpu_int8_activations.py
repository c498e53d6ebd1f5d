"""cpu_int8_activations: the engine on our CPU kernel's integer path (activations rounded to int8
per block of 32), against transformers holding gguf's dequantized weights. Not exact, so not
token equality: every logprob close to HF's (teacher-forced on our tokens), and greedy tokens
mostly HF's: this tiny random model's nearly flat distribution over 512 tokens flips its argmax
on a smaller change than a trained model's (the measured agreement: docs/perf/gguf-cpu.md). The
kernel's own tests: tests/kernels/test_cpu_int8_matmul.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from tests.gguf_models import hf_model_from, write_tiny_gguf
from tests.model_inputs import prefill_inputs
from tests.utils import core_of, hf_greedy_tokens, kv_budget_kwargs, runner_of

if jax.default_backend() != "cpu" or not cpu_dequant_matmul.available():
    pytest.skip("needs our CPU kernel on JAX's CPU backend", allow_module_level=True)
if not cpu_dequant_matmul.int8_supported():
    pytest.skip("the integer path needs x86 with AVX2", allow_module_level=True)

LOGPROB_ATOL = 0.1  # nats: about twice what this model measures (docs/perf/gguf-cpu.md)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_int8") / "tiny.gguf"
    return path, hf_model_from(write_tiny_gguf(path))


def _weights(tree) -> list[GGUFWeight]:
    return [w for w in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, GGUFWeight))
            if isinstance(w, GGUFWeight)]


def test_matmul_weights_take_the_integer_layout_and_logprobs_stay_close(tiny_gguf):
    """Every block weight a matmul reads gets the integer layout (every format of the tiny
    model, Q8_0's LM head signed); the embedding, only gathered, keeps the exact one. Prompt
    logprobs at every position and token close to HF's."""
    path, hf = tiny_gguf
    loaded = load_model(path, progress=False, quantization="gguf", gguf_layout="int8")
    tree = loaded.params
    assert not tree["embed_tokens"].int8
    assert tree["lm_head"].int8 and tree["lm_head"].qweight.dtype == np.int8
    layers = _weights({k: v for k, v in tree.items() if k.startswith("layers_")})
    assert len(layers) == 4 + 3 and all(w.int8 for w in layers)  # layer 1's o_proj is F16
    prompts = [[1, 5, 9, 100, 200], list(range(30, 47))]
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    logits, _, _ = jax.jit(Qwen2ForCausalLM(loaded.config).apply)(
        {"params": tree, "rope": rope_variables(loaded.config)}, ids, pos, kv, md)
    with torch.no_grad():
        want = np.concatenate([torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), -1)
                               .numpy() for p in prompts])
    got = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
    assert np.max(np.abs(np.asarray(got) - want)) < LOGPROB_ATOL


def test_engine_logprobs_close_to_hf_and_greedy_tokens_mostly_equal(tiny_gguf, rng):
    path, hf = tiny_gguf
    llm = LLM(model=str(path), quantization="gguf", cpu_int8_activations=True,
              skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, show_progress=False, multiprocess_mode=False,
              **kv_budget_kwargs())
    assert core_of(llm).config.cpu_int8_activations
    assert "jaxllm_int8_matmul" in runner_of(llm).get_compiled_hlo(1, 1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (3, 17, 30, 9, 5, 12, 22, 40)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    agreeing = identical = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf_greedy_tokens(hf, prompt, 16)
            hf_logprobs = torch.log_softmax(
                hf(torch.tensor([prompt + tokens])).logits[0].double(), -1).numpy()
        ours = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        theirs = [hf_logprobs[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=LOGPROB_ATOL)
        agreeing += next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True))
                          if a != b), 16)
        identical += tokens == ref
    assert agreeing >= 0.75 * 16 * len(prompts), agreeing
    assert identical >= len(prompts) // 2, identical
