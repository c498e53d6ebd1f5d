"""Async scheduling and top-K sampling in the engine.

Oracle: the synchronous engine sampling full logits rows. Every combination of async
scheduling and top-K sampling must give the same tokens, logprobs, prompt logprobs and finish
reasons for a mix of greedy, seeded and processed (penalties, bias, min_tokens) requests, also
under preemption and chunked prefill; aborts and stops must leave every block free. The tiny
model has a 4096-token vocabulary so the device's two-stage top-K search runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.sample import host_sampler
from tests.utils import assert_pool_free, kv_budget_kwargs, save_tiny_checkpoint, scheduler_state

VOCAB = 4096


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tiny_vocab4096")
    save_tiny_checkpoint(p, tied=False, vocab_size=VOCAB, seed=7)
    return p


def make(path, async_scheduling: bool, topk_sampling: bool, **kw) -> LLM:
    # In process: the tests count the host sampler's calls (a monkeypatch in this process).
    args = dict(skip_tokenizer_init=True, max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=64, show_progress=False, multiprocess_mode=False,
                async_scheduling=async_scheduling, topk_sampling=topk_sampling,
                **kv_budget_kwargs())
    args.update(kw)
    return LLM(model=str(path), **args)


def request_mix(rng) -> tuple[list[dict], list[SamplingParams]]:
    prompts, params = [], []
    kinds = [
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.0, prompt_logprobs=2),
        dict(temperature=0.8, top_k=20, top_p=0.9, logprobs=5),
        dict(temperature=1.0, top_k=40),
        dict(temperature=0.7, min_p=0.05),
        dict(temperature=1.2, min_p=0.02, top_p=0.8, logprobs=1),
        dict(temperature=1.0),  # full row
        dict(temperature=0.9, top_p=0.7),  # full row
        dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2),
        dict(temperature=1.0, top_k=10, presence_penalty=0.5, logit_bias={7: 2.0}),
        dict(temperature=0.0, min_tokens=5, stop_token_ids=[3, 11, 17]),
        dict(temperature=0.8, top_k=30, n=3),
        dict(temperature=0.0, max_tokens=1),
    ]
    for i, kw in enumerate(kinds):
        kw = {"max_tokens": int(rng.integers(4, 20)), "seed": 1000 + i, **kw}
        params.append(SamplingParams(**kw))
        prompts.append({"prompt_token_ids": rng.integers(0, VOCAB,
                                                         int(rng.integers(3, 40))).tolist()})
    return prompts, params


def assert_close(got, want, where: str) -> None:
    """Equal, except floats (logprobs) within 1e-4."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4), where
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, where)
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_close(got[k], want[k], where)
    elif hasattr(want, "logprob"):
        assert (got.rank, got.decoded_token) == (want.rank, want.decoded_token), where
        assert_close(got.logprob, want.logprob, where)
    else:
        assert got == want, where


def summary(outs) -> list:
    res = []
    for o in outs:
        res.append((o.prompt_logprobs, [
            (c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
            for c in o.outputs]))
    return res


@pytest.fixture(scope="module")
def sync_full(path):
    return make(path, False, False)


@pytest.fixture(scope="module")
def async_topk(path):
    return make(path, True, True)


def _run_configs(llms: dict, params, prompts, monkeypatch, preempting: bool) -> None:
    fast_rows = []
    original = host_sampler.sample_from_topk

    def counting(topk, ps, u, *rest):
        fast_rows.append(len(ps))
        return original(topk, ps, u, *rest)

    monkeypatch.setattr(host_sampler, "sample_from_topk", counting)
    results = {}
    for (async_on, topk_on), llm in llms.items():
        fast_rows.clear()
        preemptions = scheduler_state(llm)["num_preemptions"]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[(async_on, topk_on)] = summary(outs)
        assert (sum(fast_rows) > 0) == topk_on
        assert llm.llm_engine.engine_config.async_scheduling == async_on
        assert_pool_free(llm)
        assert (scheduler_state(llm)["num_preemptions"] > preemptions) == preempting
    # Same tokens everywhere. Logprobs to float32 rounding: with top-K sampling on, their
    # normaliser is the device's float32 log-sum-exp (the host's is summed in float64), and
    # async scheduling batches requests differently (a finishing request rides one step more;
    # XLA's CPU matmuls round differently per batch shape). That the candidate and full-row
    # samplers agree bit for bit on the same logits is tested in test_topk_sampling.py.
    for key, got in results.items():
        for i, (w, g) in enumerate(zip(results[(False, False)], got, strict=True)):
            assert_close(g, w, f"{key}: request {i} ({params[i]})")


def test_async_and_topk_give_the_synchronous_full_row_outputs(path, sync_full, async_topk,
                                                              monkeypatch):
    prompts, params = request_mix(np.random.default_rng(0))
    llms = {(False, False): sync_full, (True, True): async_topk,
            (True, False): make(path, True, False), (False, True): make(path, False, True)}
    _run_configs(llms, params, prompts, monkeypatch, preempting=False)


def test_same_outputs_under_preemption_and_chunked_prefill(path, monkeypatch):
    prompts, params = request_mix(np.random.default_rng(0))
    regime = {"num_kv_blocks": 10, "max_num_batched_tokens": 16}
    llms = {(False, False): make(path, False, False, **regime),
            (True, True): make(path, True, True, **regime)}
    _run_configs(llms, params, prompts, monkeypatch, preempting=True)


def test_async_aborts_and_stops_leave_every_block_free(sync_full, async_topk):
    llm, sync = async_topk, sync_full
    engine = llm.llm_engine
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, 12).tolist() for _ in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids
            for o in sync.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                   use_tqdm=False)]
    # A stop token generated mid-stream: the request is already in the next step, whose
    # token must not appear.
    stop_sp = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[want[5][6]])
    for i, p in enumerate(prompts[:5]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    engine.add_request("stop", {"prompt_token_ids": prompts[5]}, stop_sp)
    done = {}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            done[o.request_id] = o
        if step == 5:
            engine.abort_request(["r1", "r3"])
    assert set(done) == {"r0", "r2", "r4", "stop"}
    for i in (0, 2, 4):
        assert done[f"r{i}"].outputs[0].token_ids == want[i]
    stop_at = want[5].index(want[5][6]) + 1
    assert done["stop"].outputs[0].token_ids == want[5][:stop_at]
    assert done["stop"].outputs[0].finish_reason == "stop"
    assert_pool_free(llm)
    # The engine goes on serving after the pipeline drained.
    again = llm.generate({"prompt_token_ids": prompts[0]}, sp, use_tqdm=False)
    assert again[0].outputs[0].token_ids == want[0]
    assert_pool_free(llm)


def test_a_reused_request_id_never_gets_the_old_requests_results(sync_full, async_topk):
    """With async scheduling a step's results are applied a step late: an id aborted and
    added again at once must get only its new request's tokens."""
    engine = async_topk.llm_engine
    rng = np.random.default_rng(2)
    first, second = rng.integers(0, VOCAB, 9).tolist(), rng.integers(0, VOCAB, 21).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = sync_full.generate({"prompt_token_ids": second}, sp, use_tqdm=False)
    engine.add_request("x", {"prompt_token_ids": first}, sp)
    for _ in range(4):
        engine.step()
    engine.abort_request(["x"])
    engine.add_request("x", {"prompt_token_ids": second}, sp)
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [o.outputs[0].token_ids for o in done] == [want[0].outputs[0].token_ids]
    assert_pool_free(async_topk)
