"""quantization="gguf" with a Pallas kernel backend: every GGUF block weight stays quantized in
one param tree and every bucket's matmuls run the fused dequant kernel
(pallas_kernels/dequant_matmul.py). On CPU the kernel runs in interpret mode; the native Triton
backend runs where a CUDA GPU is (tests/kernel_backends.py). Oracles: transformers holding
gguf's dequantized weights, and the engine with the reference (XLA) backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.layers.rotary_embedding import rope_variables
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from jaxllm.worker.model_runner import float32_weights
from tests.gguf_models import hf_model_from, write_tiny_gguf
from tests.kernel_backends import KERNEL_BACKENDS
from tests.model_inputs import prefill_inputs
from tests.utils import runner_of

MAX_NEW = 8


def _quantized(tree) -> list[GGUFWeight]:
    return [w for w in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, GGUFWeight))
            if isinstance(w, GGUFWeight)]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gguf_kernel") / "tiny.gguf"
    return path, hf_model_from(write_tiny_gguf(path, seed=1))


def test_one_all_quantized_tree_matches_hf(tiny_gguf):
    path, hf = tiny_gguf
    loaded = load_model(path, progress=False, quantization="gguf", kernel_backend="interpret")
    assert loaded.gemv_params is None  # one tree for every bucket
    params = loaded.params
    # Every block weight, down_proj and the LM head included (the XLA path keeps those float32
    # for some buckets); layer 1's o_proj is float16 in the file and stays dense.
    assert len(_quantized(params)) == 4 + 3 + 2
    assert isinstance(params["layers_0"]["mlp"]["down_proj"]["weight"], GGUFWeight)
    assert isinstance(params["lm_head"], GGUFWeight)
    assert not isinstance(params["layers_1"]["self_attn"]["o_proj"]["weight"], GGUFWeight)
    # 20 prompt rows, all with logits: the tiled GEMM kernel (decode steps run the GEMV).
    prompts = [[1, 5, 9, 100, 200, 7, 3, 11, 300, 42], list(range(30, 40))]
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts)
    with torch.no_grad():
        want = np.concatenate([hf(torch.tensor([p])).logits[0].numpy() for p in prompts])
    model = Qwen2ForCausalLM(loaded.config, kernel_backend="interpret")
    logits, _, _ = jax.jit(model.apply)(
        {"params": params, "rope": rope_variables(loaded.config)}, ids, pos, kv, md)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_greedy_tokens_match_reference_backend_and_hf(tiny_gguf, backend, rng):
    path, hf = tiny_gguf
    # Interpret-mode kernels make every step slow on CPU: two sequences, two decode buckets
    # (1 and 2 rows: GEMV) and one token bucket (16 rows: GEMM; the 21-token prompt is chunked).
    prompts = [rng.integers(0, 512, n).tolist() for n in (21, 6)]
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    kw = dict(model=str(path), quantization="gguf", skip_tokenizer_init=True,
              max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=32,
              show_progress=False, dtype="float32")

    def greedy(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    llm = LLM(kernel_backend=backend, multiprocess_mode=False, **kw)  # reads the weight tree
    runner = runner_of(llm)
    assert runner.gemv_params is None and len(_quantized(runner.params)) == 9
    got = greedy(llm)
    # Decode buckets (GEMV) and token buckets (GEMM) both ran.
    shapes = llm.collective_rpc("get_step_shape_counts")
    assert any(q == 1 for _, q, _ in shapes)
    assert any(q > 1 for _, q, _ in shapes)
    assert got == greedy(LLM(kernel_backend="reference", **kw))
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()


def test_bfloat16_activations_load_and_keep_weights_quantized(tiny_gguf):
    path, _ = tiny_gguf
    loaded = load_model(path, dtype=jnp.bfloat16, progress=False, quantization="gguf",
                        kernel_backend="interpret")
    q = _quantized(loaded.params)
    assert len(q) == 9 and all(w.qweight.dtype == jnp.int8 for w in q)
    norm = loaded.params["layers_0"]["input_layernorm"]["weight"]
    assert norm.dtype == jnp.bfloat16
    # The CPU runner's float32 GEMV copies leave quantized weights alone.
    f32 = float32_weights(loaded.params)
    assert all(a is b for a, b in zip(_quantized(f32), q, strict=True))
    assert f32["layers_1"]["self_attn"]["o_proj"]["weight"].dtype == jnp.float32


@pytest.mark.parametrize("prompts,kernel", [([[5]], "dequant_gemv"),
                                            ([list(range(1, 21))], "dequant_gemm")])
def test_model_lowers_for_cuda_with_the_kernel_on_every_quantized_weight(tiny_gguf, prompts,
                                                                         kernel):
    """With kernel_backend="pallas" a whole bfloat16 forward pass lowers for CUDA (no GPU
    needed), every quantized matmul through the dequant kernel: one row takes the GEMV, 20 rows
    the GEMM."""
    from pallas_kernels.checks.triton_compile import triton_kernels

    path, _ = tiny_gguf
    loaded = load_model(path, dtype=jnp.bfloat16, progress=False, quantization="gguf",
                        kernel_backend="pallas")
    model = Qwen2ForCausalLM(loaded.config, dtype=jnp.bfloat16, kernel_backend="pallas")
    ids, pos, kv, md = prefill_inputs(loaded.config, prompts, dtype=jnp.bfloat16)
    q_len = len(prompts[0])

    def forward(params, ids, pos, kv, md):
        return model.apply({"params": params, "rope": rope_variables(loaded.config)}, ids, pos,
                           kv, md, max_query_len=q_len)

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (loaded.params, ids, pos, kv, md))
    names = [k.name for k in triton_kernels(forward, abstract)]
    # The lowered module holds each distinct kernel once: one per distinct quantized matmul
    # (shape, block size, offsets or not), the embedding table being a gather.
    matmuls = {(w.shape, w.block_size, w.offset is None)
               for w in _quantized({**loaded.params, "embed_tokens": None})}
    assert len(matmuls) > 3 and names.count(kernel) == len(matmuls), " ".join(names)
    assert not [n for n in names if n.startswith("dequant") and n != kernel]
    assert "paged_attention" in names  # the rest of the model is on the Pallas kernels too
