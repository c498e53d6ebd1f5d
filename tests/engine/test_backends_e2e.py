"""End to end: the model gives identical greedy tokens with every kernel backend.

`reference` (XLA ops) is what CPU runs; `interpret` runs the Pallas kernels themselves (Pallas
interpret mode) inside the full engine; `pallas` runs them natively and needs a CUDA GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from tests.kernel_backends import KERNEL_BACKENDS
from tests.utils import runner_of

MAX_NEW = 12


def _greedy(llm: LLM, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# A small budget mixes chunked prefill with decodes inside single steps. (max_model_len 128 is
# too short to split decode: split-K's kernels have their own interpret-mode tests.) float32:
# the tokens are compared with HF's float32 model.
TINY_ENGINE = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=32, show_progress=False, dtype="float32")


@pytest.fixture(scope="module")
def tiny_case(tiny_models, kv_budget):
    """(path, prompts, reference-backend in-process tokens, HF greedy tokens)."""
    path, hf = tiny_models["tied"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 37, 20)]
    ref_llm = LLM(model=str(path), kernel_backend="reference", multiprocess_mode=False,
                  **TINY_ENGINE, **kv_budget)
    ref = _greedy(ref_llm, prompts, MAX_NEW)
    ref_llm.shutdown()
    want = []
    for prompt in prompts:
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                 min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        want.append(hf_out[0, len(prompt):].tolist())
    assert ref == want
    return path, prompts, ref, want


def _backend_cases() -> list:
    """(backend, multiprocess_mode) cases. Both engine modes where the core in its own process
    matters: the native kernels (a GPU, where it is the default) and the reference backend
    against its in-process self on CPU. Interpret mode runs in process only: its compile takes
    over a minute on CPU and its tokens do not depend on the mode."""
    cases = [pytest.param("reference", True, id="reference-mp")]
    for entry in KERNEL_BACKENDS:
        backend, marks = getattr(entry, "values", (entry,))[0], getattr(entry, "marks", ())
        modes = (False, True) if backend == "pallas" else (False,)
        cases += [pytest.param(backend, mp, marks=marks,
                               id=f"{backend}-{'mp' if mp else 'inproc'}") for mp in modes]
    return cases


@pytest.mark.parametrize("backend, multiprocess_mode", _backend_cases())
def test_tiny_model_same_tokens_on_every_backend(tiny_case, kv_budget, backend,
                                                 multiprocess_mode):
    path, prompts, ref, want = tiny_case
    llm = LLM(model=str(path), kernel_backend=backend, multiprocess_mode=multiprocess_mode,
              **TINY_ENGINE, **kv_budget)
    assert llm.llm_engine.engine_config.kernel_backend == backend
    got = _greedy(llm, prompts, MAX_NEW)
    llm.shutdown()
    assert got == ref
    assert got == want


def _layerwise_greedy(llm: LLM, prompt: list[int], max_new: int, backend: str) -> list[int]:
    """Greedy decoding of the real model, one jitted decoder layer applied 24 times.

    The engine unrolls all 24 layers into one XLA program; with interpret-mode kernels that
    program takes many minutes to compile on 2 cores. Every layer has the same shapes, so here
    one jitted layer (its KV given as a one-layer slice) serves all of them: same weights,
    same kernels, same math, compiled once per shape.
    """
    import jax
    import jax.numpy as jnp

    from jaxllm.model_executor.layers.attention import AttentionMetadata, kv_cache_shape
    from jaxllm.model_executor.layers.logits import compute_logits
    from jaxllm.model_executor.layers.quantization import cpu_dequant_matmul
    from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight, dequantize
    from jaxllm.model_executor.layers.rotary_embedding import rope_variables
    from jaxllm.model_executor.models.llama import LlamaDecoderLayer
    from pallas_kernels.rms_norm import rms_norm

    engine = llm.llm_engine
    cfg, params = engine.model_config, runner_of(llm).params
    if backend != "reference":  # the Pallas kernels read GGUF blocks as rows, not as panels
        params = jax.tree.map(
            lambda w: GGUFWeight(*(None if a is None else cpu_dequant_matmul.unpack(a)
                                   for a in w)) if isinstance(w, GGUFWeight) and w.packed else w,
            params, is_leaf=lambda x: isinstance(x, GGUFWeight))
    layer = LlamaDecoderLayer(cfg, 0, jnp.float32, backend)
    cos_sin = rope_variables(cfg)["cos_sin_cache"]

    @jax.jit
    def run_layer(p, h, residual, positions, kv, md):
        return layer.apply({"params": p}, h, residual, positions, kv, md, cos_sin, None)

    block_size, num_blocks = 16, 4
    kv = [jnp.zeros(kv_cache_shape(cfg, num_blocks, block_size), jnp.float32)[:1]
          for _ in range(cfg.num_hidden_layers)]
    tokens = list(prompt)
    new: list[int] = []
    start = 0
    while len(new) < max_new:
        step_ids = tokens[start:]
        n = len(step_ids)
        pos = np.arange(start, start + n, dtype=np.int32)
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(pos), block_tables=jnp.arange(num_blocks)[None],
            seq_lens=jnp.asarray([start + n], jnp.int32),
            query_start_loc=jnp.asarray([0, n], jnp.int32),
            logits_indices=jnp.asarray([n - 1], jnp.int32))
        embed = params["embed_tokens"]
        if isinstance(embed, GGUFWeight):  # quantization="gguf" (the CPU default for a .gguf)
            h = dequantize(embed, jnp.asarray(step_ids))
        else:
            h = embed[jnp.asarray(step_ids)]
        residual = None
        for i in range(cfg.num_hidden_layers):
            h, residual, kv[i] = run_layer(params[f"layers_{i}"], h, residual,
                                           jnp.asarray(pos), kv[i], md)
        h, _ = rms_norm(h, params["norm"]["weight"], cfg.rms_norm_eps, residual, backend=backend)
        next_token = int(np.argmax(np.asarray(compute_logits(params, cfg, h[-1:]))[0]))
        new.append(next_token)
        tokens.append(next_token)
        start += n
    return new


@pytest.mark.real_model
def test_real_model_same_tokens_with_interpret_kernels(real_llm):
    tok = real_llm.tokenizer
    prompt = tok.encode("def fibonacci(n):")
    engine_tokens = _greedy(real_llm, [prompt], 4)[0]
    assert _layerwise_greedy(real_llm, prompt, 4, "reference") == engine_tokens
    assert _layerwise_greedy(real_llm, prompt, 4, "interpret") == engine_tokens


@pytest.mark.real_model
@pytest.mark.parametrize("backend", KERNEL_BACKENDS[1:])
def test_real_model_same_tokens_in_engine_on_gpu(real_model_path, real_llm, kv_budget, backend):
    tok = real_llm.tokenizer
    prompts = [tok.encode("def fibonacci(n):"), tok.encode("请用中文介绍一下你自己。")]
    llm = LLM(model=str(real_model_path), kernel_backend=backend, dtype="float32",
              max_num_seqs=4, max_num_batched_tokens=64, show_progress=False, **kv_budget)
    assert _greedy(llm, prompts, 16) == _greedy(real_llm, prompts, 16)


def test_pallas_gemv_gives_the_same_tokens(tiny_case, kv_budget):
    # Decode buckets of up to 4 rows (all of them here) run every dense weight matmul and the
    # LM head through the Pallas GEMV kernel, in interpret mode: still HF's tokens.
    path, prompts, ref, want = tiny_case
    llm = LLM(model=str(path), kernel_backend="interpret", multiprocess_mode=False,
              pallas_gemv_max_rows=4, **TINY_ENGINE, **kv_budget)
    assert llm.llm_engine.engine_config.pallas_gemv_max_rows == 4
    hlo = runner_of(llm).get_compiled_hlo(4, 1)
    got = _greedy(llm, prompts, MAX_NEW)
    llm.shutdown()
    assert "skinny_matmul" in hlo
    assert got == ref == want
