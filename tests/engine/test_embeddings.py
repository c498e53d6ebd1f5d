"""The pooling runner (embeddings) against Hugging Face: the final-normed hidden states of the
prompt, pooled LAST / MEAN / CLS and normalized, with chunked prefill (a 16-token budget), prefix
-cache hits, mixed-length batches, both engine modes and both scheduling modes; Matryoshka
`dimensions`; the refusals of bad combinations."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, PoolingParams, SamplingParams
from jaxllm.outputs import EmbeddingRequestOutput
from tests.utils import assert_pool_free, hf_pooled, make_llm, scheduler_state

TOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["untied"]


@pytest.fixture(scope="module")
def embed_prompts():
    rng = np.random.default_rng(7)
    lens = [3, 70, 17, 40, 1, 33]
    base = [rng.integers(0, 512, n).tolist() for n in lens]
    # Shares three full 16-token blocks with the 70-token prompt: a prefix-cache hit.
    base.append(base[1][:48] + rng.integers(0, 512, 9).tolist())
    return base


def _engine(tiny, **kw) -> LLM:
    return make_llm(tiny[0], runner="pooling", **{"max_num_batched_tokens": 16, **kw})


@pytest.fixture(scope="module")
def last_llm(tiny):
    """LAST pooling, in process, async scheduling (the default), prefix caching on."""
    llm = _engine(tiny, multiprocess_mode=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mean_llm(tiny):
    """MEAN pooling with the core in its own process."""
    llm = _engine(tiny, multiprocess_mode=True, pooler_config={"pooling_type": "MEAN"})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def cls_llm(tiny):
    """CLS pooling, synchronous steps."""
    llm = _engine(tiny, multiprocess_mode=False, async_scheduling=False,
                  pooler_config='{"pooling_type": "CLS"}')
    yield llm
    llm.shutdown()


def _check(outs, hf, prompts, pooling_type, **kw) -> None:
    assert len(outs) == len(prompts)
    for out, prompt in zip(outs, prompts, strict=True):
        assert isinstance(out, EmbeddingRequestOutput) and out.finished
        assert out.prompt_token_ids == prompt
        want = hf_pooled(hf, prompt, pooling_type, **kw)
        got = np.asarray(out.outputs.embedding)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_hf_hidden_states_last_entry_is_final_normed(tiny):
    import torch

    hf = tiny[1]
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        entries = hf(ids, output_hidden_states=True).hidden_states
        normed = hf.model(ids).last_hidden_state  # Qwen2Model ends with its final norm
    assert len(entries) == hf.config.num_hidden_layers + 1
    assert torch.equal(entries[-1], normed)


def test_last_pooling_chunked_batch_and_prefix_hits(last_llm, tiny, embed_prompts):
    prompts = [{"prompt_token_ids": p} for p in embed_prompts]
    outs = last_llm.embed(prompts, use_tqdm=False)
    _check(outs, tiny[1], embed_prompts, "LAST")
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    # Again: the 70-token prompt's blocks are cached now, so every long prompt hits.
    again = last_llm.embed(prompts, use_tqdm=False)
    _check(again, tiny[1], embed_prompts, "LAST")
    assert again[1].num_cached_tokens == 64
    assert_pool_free(last_llm)


def test_mean_pooling_multiprocess_chunked(mean_llm, tiny, embed_prompts):
    prompts = [{"prompt_token_ids": p} for p in embed_prompts]
    _check(mean_llm.embed(prompts, use_tqdm=False), tiny[1], embed_prompts, "MEAN")
    # MEAN needs every row: a repeat computes them again instead of taking cached blocks.
    again = mean_llm.embed(prompts[:2], use_tqdm=False)
    _check(again, tiny[1], embed_prompts[:2], "MEAN")
    assert again[1].num_cached_tokens == 0
    assert_pool_free(mean_llm)


def test_mean_pooling_through_preemptions(tiny, embed_prompts):
    """A KV cache of six usable blocks for prompts of up to five: a running request loses its
    blocks mid-prompt and is recomputed; its sum starts over with the recompute."""
    llm = _engine(tiny, multiprocess_mode=False, num_kv_blocks=7, max_num_batched_tokens=32,
                  pooler_config={"pooling_type": "MEAN"})
    try:
        prompts = [{"prompt_token_ids": p} for p in embed_prompts]
        _check(llm.embed(prompts, use_tqdm=False), tiny[1], embed_prompts, "MEAN")
        assert scheduler_state(llm)["num_preemptions"] > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_cls_pooling_sync(cls_llm, tiny, embed_prompts):
    prompts = [{"prompt_token_ids": p} for p in embed_prompts]
    _check(cls_llm.embed(prompts, use_tqdm=False), tiny[1], embed_prompts, "CLS")
    assert_pool_free(cls_llm)


def test_dimensions_and_normalize(last_llm, mean_llm, tiny, embed_prompts):
    prompt = {"prompt_token_ids": embed_prompts[1]}
    hf = tiny[1]
    out = last_llm.embed(prompt, PoolingParams(dimensions=8), use_tqdm=False)[0]
    assert len(out.outputs.embedding) == 8
    assert np.isclose(np.linalg.norm(out.outputs.embedding), 1.0, atol=1e-6)
    _check([out], hf, [embed_prompts[1]], "LAST", dimensions=8)
    raw = mean_llm.embed(prompt, PoolingParams(normalize=False), use_tqdm=False)[0]
    _check([raw], hf, [embed_prompts[1]], "MEAN", normalize=False)
    # One PoolingParams per prompt.
    outs = last_llm.embed([prompt, prompt], [PoolingParams(dimensions=4), PoolingParams()],
                          use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outs] == [4, hf.config.hidden_size]


def test_truncate_prompt_tokens(last_llm, tiny, embed_prompts):
    prompt = embed_prompts[1]
    out = last_llm.embed({"prompt_token_ids": prompt}, PoolingParams(truncate_prompt_tokens=20),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-20:]
    _check([out], tiny[1], [prompt[-20:]], "LAST")


def test_refusals(last_llm, tiny):
    hidden = tiny[1].config.hidden_size
    with pytest.raises(ValueError, match="dimensions"):
        last_llm.embed({"prompt_token_ids": [1, 2]}, PoolingParams(dimensions=hidden + 1),
                       use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="runner='pooling'"):
        last_llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2),
                          use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        last_llm.embed({"prompt_token_ids": [1, 2]}, SamplingParams(),  # type: ignore[arg-type]
                       use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(str(tiny[0]), pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="pooler_config.pooling_type"):
        LLM(str(tiny[0]), runner="pooling", pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(str(tiny[0]), runner="embed")
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(tiny[0]), runner="pooling",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert scheduler_state(last_llm)["num_requests"] == 0


def test_generate_engine_refuses_embed(tiny):
    llm = make_llm(tiny[0], multiprocess_mode=False, max_num_batched_tokens=16)
    try:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.llm_engine.add_request("x", {"prompt_token_ids": [1, 2]}, PoolingParams())
        with pytest.raises(TypeError, match="LLM.embed"):
            llm.generate({"prompt_token_ids": [1, 2]}, [PoolingParams()],  # type: ignore[list-item]
                         use_tqdm=False)
        assert_pool_free(llm)
    finally:
        llm.shutdown()


def test_a_prompt_may_fill_max_model_len(last_llm, tiny):
    """Nothing is generated, so no room for a new token is kept: a prompt of max_model_len
    tokens is embedded as HF embeds it, one more is refused, and -1 truncates to it."""
    n = last_llm.llm_engine.max_model_len
    prompt = np.random.default_rng(3).integers(0, 512, n + 5).tolist()
    outs = last_llm.embed([{"prompt_token_ids": prompt[:n]},
                           {"prompt_token_ids": prompt}],
                          [PoolingParams(), PoolingParams(truncate_prompt_tokens=-1)],
                          use_tqdm=False)
    assert outs[1].prompt_token_ids == prompt[-n:]
    _check(outs, tiny[1], [prompt[:n], prompt[-n:]], "LAST")
    with pytest.raises(ValueError, match=f"the prompt has {n + 1} tokens"):
        last_llm.embed({"prompt_token_ids": prompt[:n + 1]}, use_tqdm=False)
    assert scheduler_state(last_llm)["num_requests"] == 0
