"""The device's top-K candidates and the host's candidate sampler.

Oracles: a stable numpy sort for the device's top-K (ties lower id first), scipy's logsumexp
for its normaliser, and the full-row sampler for the candidate sampler: on every row the rule
calls exact, both give the same token, the same sampled logprob and the same logprob rows
(bit for bit), seeded or not.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp

from jaxllm.sample.candidates import TopKLogits, exact_rows, sample_from_topk
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.sampler import SamplingRow, needs_processing, sample
from jaxllm.sample.topk import TOPK
from jaxllm.sampling_params import SamplingParams
from tests.sampling_cases import device_topk, llm_like, param_mix

QWEN_VOCAB = 151936
def with_ties(rng, rows: int, vocab: int) -> np.ndarray:
    """Coarse values: many exact ties, across blocks and at every cut."""
    return (np.round(rng.normal(0, 2, (rows, vocab)) * 2) / 2).astype(np.float32)


@pytest.mark.parametrize("vocab", [64, 100, 2048 + 7, 5000, QWEN_VOCAB])
def test_device_top_k_holds_the_k_largest_in_canonical_order(rng, vocab):
    x = np.concatenate([llm_like(rng, 3, vocab), with_ties(rng, 3, vocab),
                        np.zeros((1, vocab), np.float32)])  # all tied
    k = min(TOPK, vocab)
    got = device_topk(x, k)
    want = -np.sort(-x, axis=1)[:, :k]
    np.testing.assert_array_equal(got.values, want)  # exactly the k largest values
    for r in range(len(x)):
        ids = got.token_ids[r]
        assert len(set(ids.tolist())) == k
        np.testing.assert_array_equal(x[r, ids], got.values[r])
        # every token above the k-th value is there; the order is value, then token id
        assert set(np.flatnonzero(x[r] > want[r, -1])) <= set(ids.tolist())
        np.testing.assert_array_equal(np.lexsort((ids, -got.values[r])), np.arange(k))
    # without ties the candidates are numpy's stable sort
    order = np.argsort(-x[:3], axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(got.token_ids[:3], order)
    np.testing.assert_allclose(got.lse, logsumexp(x.astype(np.float64), axis=1), rtol=1e-6)


def _check_identical(x: np.ndarray, params: list[SamplingParams], topk: TopKLogits,
                     exact: np.ndarray) -> None:
    fast = np.flatnonzero(exact)
    sub = TopKLogits(topk.values[fast], topk.token_ids[fast], topk.lse[fast])
    ps = [params[i] for i in fast]
    gens = [np.random.default_rng(p.seed) for p in ps]
    u = np.array([0.0 if p.greedy else g.random() for p, g in zip(ps, gens, strict=True)])
    tokens, sampled_lp, logprobs = sample_from_topk(sub, SamplingMetadata.from_params(ps), u)
    rows = [SamplingRow(p, np.random.default_rng(p.seed)) for p in ps]
    want = sample(x[fast], rows, lse=topk.lse[fast])
    np.testing.assert_array_equal(tokens, want.token_ids)
    np.testing.assert_array_equal(sampled_lp, want.sampled_logprobs)
    assert logprobs == want.logprobs


@pytest.mark.parametrize("vocab", [5000, QWEN_VOCAB])
def test_candidate_sampler_equals_full_row_sampler(rng, vocab):
    rows = 48 if vocab == 5000 else 12
    for trial in range(6 if vocab == 5000 else 1):
        x = llm_like(rng, rows, vocab, spread=[0.5, 2.0, 3.0][trial % 3])
        params = param_mix(rng, rows)
        topk = device_topk(x)
        exact = exact_rows(SamplingMetadata.from_params(params), np.zeros(rows, bool), topk)
        for p, ok in zip(params, exact, strict=True):
            if p.greedy:
                assert ok
            if not p.greedy and p.top_k in (-1, TOPK) and p.min_p == 0.0:
                assert not ok  # pure temperature, top_p alone, top_k = K: the full row
        assert exact.sum() >= rows // 3
        _check_identical(x, params, topk, exact)


def test_ties_at_the_cut_decide_exactness(rng):
    vocab = 5000
    x = llm_like(rng, 5, vocab)
    # Row 0: the 10th value is tied with tokens beyond the K-th: top_k=10 is not exact.
    order = np.argsort(-x[0], kind="stable")
    x[0, order[9:TOPK + 5]] = x[0, order[9]]
    # Row 1: ties at the 10th value end inside the candidates: exact, every tie a candidate.
    order = np.argsort(-x[1], kind="stable")
    x[1, order[9:20]] = x[1, order[9]]
    # Row 2: min_p's threshold at or below the K-th value: not exact.
    # Row 3: the top value tied beyond the K-th: greedy is not exact (which tied tokens the
    # device took is unspecified, and the argmax is the lowest id of all of them).
    x[3] = 1.0
    # Row 4: a tie inside the top 3 only: greedy with 3 logprobs is exact.
    x[4, [10, 4000, 20]] = 50.0
    topk = device_topk(x)
    p10 = SamplingParams(temperature=1.0, top_k=10, seed=3, logprobs=5)
    minp = SamplingParams(temperature=1.0, min_p=float(np.exp(topk.values[2, TOPK - 1]
                                                              - topk.values[2, 0])), seed=4)
    g3 = SamplingParams(temperature=0.0, logprobs=3)
    params = [p10, p10, minp, g3, g3]
    exact = exact_rows(SamplingMetadata.from_params(params), np.zeros(5, bool), topk)
    assert exact.tolist() == [False, True, False, False, True]
    assert topk.token_ids[4, :3].tolist() == [10, 20, 4000]
    _check_identical(x, params, topk, exact)
    # Repeated draws over the tied row: every tie is drawable from the candidates.
    seen = set()
    for seed in range(200):
        p = SamplingParams(temperature=50.0, top_k=10, seed=seed)
        t, _, _ = sample_from_topk(TopKLogits(topk.values[1:2], topk.token_ids[1:2],
                                              topk.lse[1:2]),
                                   SamplingMetadata.from_params([p]),
                                   np.random.default_rng(seed).random(1))
        seen.add(int(t[0]))
    assert {int(i) for i in order[9:20]} <= seen


def test_processed_rows_and_too_many_logprobs_take_the_full_row(rng):
    x = llm_like(rng, 3, 5000)
    topk = device_topk(x)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.0, min_tokens=2)]
    rows = [SamplingRow(p, None, prompt_token_ids=[1, 2], eos_token_ids=frozenset({7}))
            for p in params]
    processed = [needs_processing(r) for r in rows]
    assert processed == [True, True, True]
    assert not exact_rows(SamplingMetadata.from_params(params), np.array(processed), topk).any()
    small = device_topk(x, 8)  # K below a row's logprobs count
    assert exact_rows(SamplingMetadata.from_params([SamplingParams(temperature=0.0, logprobs=9)]),
                      np.zeros(1, bool),
                      TopKLogits(small.values[:1], small.token_ids[:1], small.lse[:1])
                      ).tolist() == [False]
