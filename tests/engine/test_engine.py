"""The engine (scheduler + model runner + sampler + output processor) against HF transformers.

Greedy outputs must be identical to HF's under ample KV, a pool small enough to force
preemption, a token budget small enough to force chunked prefill, and shared prefixes that hit
the prefix cache; nothing compiles after warm-up; every block is free again afterwards.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

# The HF oracle. A test lane without torch still runs this module's other tests: those that need
# HF skip at the `tiny` fixture (make_tiny_checkpoint).
try:
    import torch
except ImportError:
    torch = None

from jaxllm import SamplingParams
from jaxllm.config import resolve_kv_cache_dtype
from jaxllm.model_executor.layers import cpu_attention
from tests.utils import (
    MAX_NEW,
    assert_pool_free,
    check_logprobs_close,
    compile_count,
    make_llm,
    on_each_step,
    runner_of,
    scheduler_state,
)


def greedy(prompts, llm):
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return outs, [o.outputs[0].token_ids for o in outs]


REGIMES = {
    "ample": {},
    "preemption": {"num_kv_blocks": 14},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


# The first two regimes run with the core in its own process too (the default on a GPU): what
# they assert is read through utility calls. The chunked-prefill check reads each step's
# schedule, which only an in-process core shows.
@pytest.mark.parametrize("regime, multiprocess_mode", [
    ("ample", False), ("ample", True), ("preemption", False), ("preemption", True),
    ("chunked_prefill", False), ("no_prefix_cache", False),
])
def test_greedy_matches_hf_in_every_regime(tiny, prompts, hf_greedy, regime, multiprocess_mode):
    llm = make_llm(tiny[0], dtype="float32", multiprocess_mode=multiprocess_mode,
                   **REGIMES[regime])
    steps = []
    if regime == "chunked_prefill":
        on_each_step(llm, lambda so: steps.append(
            [(r.request_id, r.num_tokens, r.do_sample) for r in so.scheduled]))
    before = compile_count(llm)
    assert before > 0  # warm-up compiled every bucket: the counter sees compiles
    outs, tokens = greedy(prompts, llm)
    assert compile_count(llm) == before, "the engine compiled after warm-up"
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == hf_greedy(tuple(prompt)), f"prompt of {len(prompt)} tokens"
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    if regime == "preemption":
        assert scheduler_state(llm)["num_preemptions"] > 0
    if regime == "chunked_prefill":
        assert any(not do_sample for step in steps for _, _, do_sample in step)
        assert max(sum(n for _, n, _ in step) for step in steps) <= 16
    if regime == "ample":
        # Requests really were batched: a decode step of two or more sequences ran.
        shapes = llm.collective_rpc("get_step_shape_counts")
        assert any(q == 1 and t > 1 for t, q, _ in shapes), shapes
    assert_pool_free(llm)
    llm.shutdown()


def test_prefix_cache_hits_are_reported_and_exact(tiny, prompts, hf_greedy):
    llm = make_llm(tiny[0], dtype="float32")
    greedy([prompts[1]], llm)  # the 70-token prompt fills 4 full blocks
    outs, tokens = greedy(prompts[-2:], llm)
    assert [o.num_cached_tokens for o in outs] == [48, 48]
    for prompt, got in zip(prompts[-2:], tokens, strict=True):
        assert got == hf_greedy(tuple(prompt))
    # The same prompt again: every full block but the one holding the last token is a hit.
    again, tokens = greedy([prompts[1]], llm)
    assert again[0].num_cached_tokens == 64
    assert tokens[0] == hf_greedy(tuple(prompts[1]))
    assert_pool_free(llm)


def test_bad_request_does_not_disturb_others(tiny, prompts, hf_greedy):
    llm = make_llm(tiny[0], dtype="float32")
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, sp)
    engine.add_request("b", {"prompt_token_ids": prompts[2]}, sp)
    engine.step()
    for bad, match in [({"prompt_token_ids": []}, "empty"),
                       ({"prompt_token_ids": [1, 10_000]}, "outside the vocabulary"),
                       ({"prompt_token_ids": [1] * 200}, "max_model_len")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request("bad", bad, sp)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", {"prompt_token_ids": [1, 2]}, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    assert done == {"a": hf_greedy(tuple(prompts[0])), "b": hf_greedy(tuple(prompts[2]))}
    assert_pool_free(llm)


def test_abort_returns_blocks(tiny, prompts):
    llm = make_llm(tiny[0])
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    engine.add_request("x", {"prompt_token_ids": prompts[1]}, sp)
    engine.add_request("y", {"prompt_token_ids": prompts[3]}, sp)
    engine.step()
    engine.step()
    (out,) = engine.abort_request("x")
    assert out.outputs[0].finish_reason == "abort" and out.finished
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(llm)


def test_seeded_sampling_independent_of_batch_company(tiny, prompts):
    llm = make_llm(tiny[0])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[2]}, seeded, use_tqdm=False)
    crowd = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                         [other, other, seeded, other], use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    # A different seed gives a different stream (12 tokens at T=0.8 on random logits).
    third = llm.generate({"prompt_token_ids": prompts[2]},
                         SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=12,
                                        ignore_eos=True), use_tqdm=False)
    assert third[0].outputs[0].token_ids != alone[0].outputs[0].token_ids
    assert_pool_free(llm)


def test_n_samples_share_the_prompt(tiny, prompts, hf_greedy):
    # In process: it reads each step's cached tokens from the schedule.
    llm = make_llm(tiny[0], dtype="float32", multiprocess_mode=False)
    out = llm.generate({"prompt_token_ids": prompts[1]},
                       SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # top_k=1 makes n=2 greedy (temperature 0 with n > 1 is refused, as in vLLM): both
    # children equal HF's greedy tokens, the second computed on the first's cached blocks.
    cached = {}
    on_each_step(llm, lambda so: cached.update(so.num_cached_tokens))
    prompt = prompts[3]  # 40 tokens, new to this engine: 2 full blocks
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=MAX_NEW,
                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tuple(prompt))] * 2
    assert sorted(cached.values()) == [0, 32]
    assert_pool_free(llm)


def test_logprobs_match_hf(tiny, prompts):
    path, hf = tiny
    llm = make_llm(path, dtype="float32")
    prompt = prompts[3]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3,
                                      prompt_logprobs=2), use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0], -1).numpy()
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    total = 0.0
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert lp[tok].rank == 1  # greedy picks the top token
        np.testing.assert_allclose(lp[tok].logprob, row[tok], atol=1e-4)
        top3 = np.argsort(-row)[:3]
        assert set(top3) <= set(lp)
        total += row[tok]
    np.testing.assert_allclose(comp.cumulative_logprob, total, atol=1e-3)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        np.testing.assert_allclose(entry[prompt[pos]].logprob, ref[pos - 1][prompt[pos]],
                                   atol=1e-4)
        assert len(entry) in (2, 3)  # top-2, plus the actual token when outside them
        # The top-2 with their ranks and logprobs (computed on the device from the step's
        # hidden states), and the actual token's rank among the HF row's values.
        for rank, tok in enumerate(np.argsort(-ref[pos - 1], kind="stable")[:2], start=1):
            assert entry[int(tok)].rank == rank
            np.testing.assert_allclose(entry[int(tok)].logprob, ref[pos - 1][tok], atol=1e-4)
        want_rank = 1 + int(np.sum(ref[pos - 1] > ref[pos - 1][prompt[pos]] + 1e-6))
        assert abs(entry[prompt[pos]].rank - want_rank) <= 1
    assert_pool_free(llm)


def test_prompt_logprobs_survive_chunking(tiny, prompts):
    path, hf = tiny
    llm = make_llm(path, dtype="float32", max_num_batched_tokens=16)
    prompt = prompts[1]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()
    got = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
    np.testing.assert_allclose(got, [ref[p - 1][prompt[p]] for p in range(1, len(prompt))],
                               atol=1e-4)
    assert_pool_free(llm)


def test_decode_steps_use_small_buckets(tiny):
    # A pure-decode step pads only to the next power of two of its sequences (on CPU a GEMM's
    # time grows with its rows); mixed steps keep the token buckets from 16 up.
    # In process: it reads which step shape each launch ran.
    llm = make_llm(tiny[0], max_num_seqs=6, multiprocess_mode=False)
    runner = runner_of(llm)
    assert runner.bucket_shapes() == [(1, 1), (2, 1), (4, 1), (8, 1), (16, 16), (32, 32),
                                      (64, 64)]
    assert [runner.bucket_for(n, decode_only=True) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 8, 8]
    assert [runner.bucket_for(n) for n in (1, 16, 17, 64)] == [16, 16, 32, 64]
    runner.reset_step_shape_counts()
    greedy([[5, 6, 7]], llm)
    assert runner.get_step_shape_counts() == [(1, 1, MAX_NEW - 1), (16, 16, 1)]


# XLA's HLO spelling of the KV array's element type.
HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_step_shape_copies_the_kv_cache(tiny, dtype):
    # The donated cache must be updated in place by every compiled step, including the tiny
    # decode buckets (a one-token scatter once made XLA copy the whole cache twice per layer).
    llm = make_llm(tiny[0], max_num_seqs=4, dtype=dtype)
    config = llm.llm_engine.engine_config
    kv = llm.collective_rpc("get_kv_cache_info")
    # A bfloat16 model keeps a float32 KV array on CPU (resolve_kv_cache_dtype), bfloat16 on
    # a GPU: the search uses whichever the engine allocated.
    assert config.dtype == dtype
    assert kv["dtype"] == config.kv_cache_dtype == resolve_kv_cache_dtype(dtype, config.platform)
    shape = f"{HLO_DTYPES[kv['dtype']]}[{','.join(map(str, kv['shape']))}]"
    assert kv["nbytes"] == np.prod(kv["shape"]) * np.dtype(jax.numpy.dtype(kv["dtype"])).itemsize
    buckets = llm.llm_engine.core_info.bucket_shapes
    assert sorted(buckets) == [(1, 1), (2, 1), (4, 1), (16, 16), (32, 32), (64, 64)]
    for num_tokens, max_query_len in buckets:
        hlo = llm.collective_rpc("get_compiled_hlo", [num_tokens, max_query_len])
        # The KV array is a parameter of the step: the search looks for the right spelling.
        assert re.search(re.escape(shape) + r"(\{[^}]*\})? parameter\(", hlo), \
            (num_tokens, max_query_len, shape)
        copies = [line for line in hlo.splitlines() if f"= {shape}" in line and " copy(" in line]
        assert not copies, (num_tokens, max_query_len, copies[:2])
        # Every step's attention is our CPU attention kernel.
        if cpu_attention.available():
            assert "jaxllm_paged_attention" in hlo, (num_tokens, max_query_len)
        # The step's outputs alias the donated KV array (and logits buffer) rather than take
        # new memory for it.
        ma = llm.collective_rpc("get_memory_analysis", [num_tokens, max_query_len])
        assert ma["alias"] >= kv["nbytes"], (num_tokens, max_query_len, ma, kv["nbytes"])
    llm.shutdown()


def test_repetition_penalty_matches_hf(tiny, prompts, hf_greedy):
    # HF's repetition penalty is vLLM's (prompt and output tokens; positive logits divided,
    # negative multiplied); the engine keeps the seen tokens per request, updated each step.
    path, hf = tiny
    llm = make_llm(path, dtype="float32")
    changed = []
    for prompt in (prompts[0], prompts[3]):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                               min_new_tokens=MAX_NEW, repetition_penalty=1.8,
                               pad_token_id=0)[0, len(prompt):].tolist()
        got = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                          repetition_penalty=1.8), use_tqdm=False)
        assert got[0].outputs[0].token_ids == want
        changed.append(want != hf_greedy(tuple(prompt)))
    assert any(changed), "the penalty changed nothing: the test would not see a wrong one"
    assert_pool_free(llm)


def test_split_k_decode_per_bucket_in_the_runner_table():
    """Split-K decode is static per decode bucket: Qwen2.5-0.5B's 2 KV heads
    at max_model_len 4096 fill 132 SMs with powers of two up to 16 splits of >= 256 keys; the
    reference backend (CPU) never splits; prefill buckets never do."""
    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.worker.model_runner import ModelRunner
    from pallas_kernels.checks.shapes import QWEN2_SHAPES

    cfg = ModelConfig.from_hf_config(QWEN2_SHAPES["qwen2.5-0.5b"].hf_config())
    kw = dict(dtype=jax.numpy.bfloat16, block_size=16, max_model_len=4096, max_num_seqs=64,
              max_num_batched_tokens=512)
    table = ModelRunner(cfg, {}, kernel_backend="pallas", **kw).bucket_table()
    assert table == [(1, 1, 16), (2, 1, 16), (4, 1, 16), (8, 1, 16), (16, 1, 8), (32, 1, 4),
                     (64, 1, 2)] + [(t, t, 1) for t in (16, 32, 64, 128, 256, 512)]
    short = ModelRunner(cfg, {}, kernel_backend="pallas", **{**kw, "max_model_len": 1024})
    assert [s for _, q, s in short.bucket_table() if q == 1] == [4, 4, 4, 4, 4, 4, 2]
    ref = ModelRunner(cfg, {}, kernel_backend="reference", **kw).bucket_table()
    assert all(s == 1 for _, _, s in ref)


def _hf_greedy_with_logprobs(hf, prompt: list[int], max_new: int,
                             k: int) -> tuple[list[int], list[dict[int, float]]]:
    """HF's float32 greedy continuation and each step's top-k logprobs."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          min_new_tokens=max_new, pad_token_id=0)
        seq = out[0].tolist()
        rows = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1).numpy()
    tokens = seq[len(prompt):]
    top = []
    for i in range(len(tokens)):
        row = rows[len(prompt) - 1 + i]
        top.append({int(t): float(row[t]) for t in np.argsort(-row, kind="stable")[:k]})
    return tokens, top


def test_bfloat16_engine_logprobs_close_to_float32_hf(tiny, prompts):
    # bfloat16 rounding may flip a near tie; where the tokens first differ each side's token
    # must be among the other's top-5 (the GPU's default dtype, checked on CPU).
    path, hf = tiny
    llm = make_llm(path, dtype="bfloat16")
    assert llm.llm_engine.engine_config.dtype == "bfloat16"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                       logprobs=5), use_tqdm=False)
    engine = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert all(len(lps) == MAX_NEW and all(len(d) >= 5 for d in lps) for _, lps in engine)
    reference = [_hf_greedy_with_logprobs(hf, p, MAX_NEW, 5) for p in prompts]
    check_logprobs_close(engine, reference, name_a="engine bf16", name_b="HF f32")
    assert_pool_free(llm)
    llm.shutdown()
