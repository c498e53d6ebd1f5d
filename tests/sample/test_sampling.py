"""SamplingParams validation and the host sampler: processing order, statistics, seeds, logprobs."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from scipy import stats
from scipy.special import log_softmax, softmax

from jaxllm.outputs import Logprob
from jaxllm.sample import sampler as S
from jaxllm.sample.sampler import SamplingRow, process_logits, sample
from jaxllm.sampling_params import MAX_LOGPROBS, SamplingParams

QWEN_VOCAB = 151936


# ---------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.2}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"seed": "x"}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"logit_bias": {3: float("inf")}}, "logit_bias"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    # Integers beyond what the engine's int64 rows / int32 token ids / msgpack wire hold.
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"n": 2**63}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -2}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 10**400}}, "logit_bias"),
    # Only canonical ASCII integer keys name tokens (int() would read all of these).
    ({"logit_bias": {" 5 ": 1.0}}, "logit_bias"),
    ({"logit_bias": {"+5": 1.0}}, "logit_bias"),
    ({"logit_bias": {"05": 1.0}}, "logit_bias"),
    ({"logit_bias": {"\u0661\u0662": 1.0}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1.0}}, "logit_bias"),
    ({"repetition_penalty": 10**400}, "repetition_penalty"),
    ({"temperature": -(10**400)}, "temperature"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} must .*, got "):
        SamplingParams(**kwargs)


def test_integer_bounds_are_inclusive():
    sp = SamplingParams(top_k=2**63 - 1, seed=2**63 - 1, max_tokens=2**63 - 1,
                        min_tokens=2**63 - 1, stop_token_ids=[2**31 - 1],
                        logit_bias={2**31 - 1: 1.0})
    assert (sp.top_k, sp.seed, sp.max_tokens, sp.min_tokens) == (2**63 - 1,) * 4
    assert sp.stop_token_ids == [2**31 - 1] and sp.logit_bias == {2**31 - 1: 1.0}


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (1, 0, 0, 1)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (1.0, 1.0, -1, 0.0, None)
    assert sp.stop == [] and sp.stop_token_ids == [] and not sp.include_stop_str_in_output
    assert not sp.ignore_eos and sp.max_tokens == 16 and sp.min_tokens == 0
    assert sp.logprobs is None and sp.prompt_logprobs is None and sp.skip_special_tokens
    assert sp.logit_bias is None and not sp.greedy


def test_normalisation_and_clone():
    sp = SamplingParams(stop="END", top_k=0, stop_token_ids=(np.int64(7),), logit_bias={"5": 2},
                        max_tokens=None, logprobs=MAX_LOGPROBS, prompt_logprobs=0, n=3)
    assert sp.stop == ["END"] and sp.top_k == -1 and sp.stop_token_ids == [7]
    assert sp.logit_bias == {5: 2.0} and sp.max_tokens is None
    assert type(sp.stop_token_ids[0]) is int
    twin = sp.clone()
    assert twin == sp and twin is not sp
    twin.stop.append("X")
    twin.logit_bias[6] = 1.0
    assert sp.stop == ["END"] and sp.logit_bias == {5: 2.0}


def test_tiny_temperature_is_greedy_and_resets_truncation():
    for t in (0, 0.0, 5e-6):
        sp = SamplingParams(temperature=t, top_p=0.5, top_k=3, min_p=0.2)
        assert sp.greedy and (sp.top_p, sp.top_k, sp.min_p) == (1.0, -1, 0.0)
    assert not SamplingParams(temperature=1e-4).greedy


# ---------------------------------------------------------------------------------------------
# Helpers


def _rows(params, seeds=None, prompt=(), output=(), eos=frozenset()):
    if isinstance(params, SamplingParams):
        params = [params]
    seeds = seeds if seeds is not None else range(len(params))
    return [SamplingRow(p, np.random.default_rng(s), list(prompt), list(output), frozenset(eos))
            for p, s in zip(params, seeds, strict=True)]


def _draws(row_logits, sp, n=6000, seed=123, **row_kw):
    """n draws from one logits row: n batch rows (a broadcast view, no copies) that share one
    generator, so the draws are n consecutive uniforms of it."""
    gen = np.random.default_rng(seed)
    logits = np.broadcast_to(np.asarray(row_logits, np.float32), (n, len(row_logits)))
    rows = [SamplingRow(sp, gen, row_kw.get("prompt", ()), row_kw.get("output", ()),
                        frozenset(row_kw.get("eos", ()))) for _ in range(n)]
    return sample(logits, rows).token_ids


def _assert_matches(draws, probs):
    """Chi-square goodness of fit over the tokens of positive probability (p-value > 1e-4: the
    seeds are fixed, so this is deterministic; a correct sampler fails it 1 time in 10^4), and
    never a token of zero probability."""
    probs = np.asarray(probs, np.float64)
    counts = np.bincount(draws, minlength=probs.shape[0])
    excluded = np.flatnonzero(counts * (probs == 0))
    assert excluded.size == 0, f"drew excluded tokens {excluded}"
    pos = probs > 0
    expected = probs[pos] / probs[pos].sum() * counts.sum()
    if pos.sum() > 1:
        p_value = stats.chisquare(counts[pos], expected).pvalue
        assert p_value > 1e-4, (counts[pos], expected)


def _reference_probs(z, sp):
    """Straightforward vLLM V1 order over the whole vocabulary with full sorts: temperature,
    min_p, top_k, top_p (renormalised after the others), in float64."""
    z = np.asarray(z, np.float64)
    probs = softmax(z / sp.temperature)
    keep = np.ones(z.shape[0], bool)
    if sp.min_p > 0:
        keep &= probs >= sp.min_p * probs.max()
    if 0 < sp.top_k < z.shape[0]:
        keep &= z >= np.sort(z)[-sp.top_k]
    if sp.top_p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        above = np.cumsum(q[order]) - q[order]
        in_p = np.zeros_like(keep)
        in_p[order[above < sp.top_p]] = True
        keep &= in_p
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def _llm_like_logits(rng, rows, vocab=QWEN_VOCAB, spread=2.0):
    """Normal noise plus a handful of strong tokens, roughly the shape of a language model's."""
    x = rng.normal(0, spread, (rows, vocab)).astype(np.float32)
    for i in range(rows):
        x[i, rng.integers(0, vocab, 20)] += rng.uniform(3, 15, 20).astype(np.float32)
    return x


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_and_top_k_1_are_argmax(rng):
    logits = rng.normal(0, 3, size=(6, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1),
              SamplingParams(temperature=0.7, top_k=1, top_p=0.5),
              SamplingParams(temperature=5.0, top_k=1, min_p=0.01),
              SamplingParams(temperature=1e-6), SamplingParams(temperature=0.05, top_k=1)]
    out = sample(logits, _rows(params))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == np.int64 and out.sampled_logprobs.dtype == np.float32


def test_greedy_rows_draw_nothing(rng):
    logits = rng.normal(size=(2, 50)).astype(np.float32)
    rows = _rows([SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3)])
    before = [r.generator.bit_generator.state for r in rows]
    sample(logits, rows)
    assert [r.generator.bit_generator.state for r in rows] == before
    # And a greedy row needs no generator at all.
    sample(logits[:1], [SamplingRow(SamplingParams(temperature=0), None, [], [])])


# ---------------------------------------------------------------------------------------------
# Statistics on small vocabularies


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(temperature):
    row = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    draws = _draws(row, SamplingParams(temperature=temperature))
    _assert_matches(draws, softmax(row / temperature))


def test_top_k_keeps_the_k_largest():
    row = np.log(np.array([0.1, 0.3, 0.05, 0.25, 0.2, 0.1]))
    draws = _draws(row, SamplingParams(temperature=1.3, top_k=3))
    want = np.where(np.isin(np.arange(6), [1, 3, 4]), softmax(row / 1.3), 0)
    _assert_matches(draws, want)


@pytest.mark.parametrize("top_p, kept", [(0.3, 1), (0.7, 2), (0.85, 3), (0.99, 4)])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
    row = np.log(np.array([0.05, 0.5, 0.15, 0.3]))  # sorted: 0.5, 0.3, 0.15, 0.05
    draws = _draws(row, SamplingParams(temperature=1.0, top_p=top_p), n=4000)
    order = [1, 3, 2, 0]
    want = np.zeros(4)
    want[order[:kept]] = np.exp(row[order[:kept]])
    _assert_matches(draws, want)


def test_min_p_is_relative_to_the_top_probability_after_temperature():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    draws = _draws(row, SamplingParams(temperature=1.0, min_p=0.6), n=4000)
    # min_p 0.6 of the top prob 0.4 = 0.24: only tokens 0 and 1 stay.
    _assert_matches(draws, [0.4, 0.3, 0, 0])
    # At temperature 2 the tempered probs are ~[.32, .28, .23, .16]: 0.6 * .32 = .19 keeps three.
    draws = _draws(row, SamplingParams(temperature=2.0, min_p=0.6), n=4000)
    tempered = softmax(row / 2.0)
    _assert_matches(draws, np.where(tempered >= 0.6 * tempered[0], tempered, 0))


def test_min_p_applies_before_top_p_as_in_vllm_v1():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    sp = SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75)
    # min_p drops 0.1 -> [.444, .333, .222]; top-p .75 of that keeps two (mass above #3 .777).
    # (top-p first over the full distribution would have kept three: mass above #3 = .7.)
    _assert_matches(_draws(row, sp, n=4000), [0.4, 0.3, 0, 0])
    np.testing.assert_allclose(_reference_probs(row, sp), [4 / 7, 3 / 7, 0, 0])


def test_combined_truncation_matches_reference_distribution(rng):
    row = rng.normal(0, 1.5, 40)
    sp = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.02)
    _assert_matches(_draws(row, sp, n=5000), _reference_probs(row, sp))


# ---------------------------------------------------------------------------------------------
# The full-vocabulary paths (Qwen2's 151936 tokens)


def test_candidates_match_full_sort_reference_at_qwen_vocab(rng):
    logits = np.concatenate([_llm_like_logits(rng, 3),
                             rng.normal(0, 3, (1, QWEN_VOCAB)).astype(np.float32),  # flat
                             _llm_like_logits(rng, 1, spread=0.5)])
    logits[4, 17] += 30.0  # one token holds almost everything
    cases = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
             for t, p, k, m in [(1.0, 0.95, -1, 0.0), (0.7, 0.9, -1, 0.0), (1.3, 0.5, -1, 0.0),
                                (1.0, 1.0, 50, 0.0), (0.8, 1.0, 5000, 0.0),
                                (1.0, 1.0, -1, 0.05), (0.9, 0.8, 40, 0.0),
                                (1.1, 0.9, -1, 1e-4), (0.6, 0.95, 200, 0.01),
                                (1.0, 0.999, -1, 0.0)]]
    buf = np.empty(QWEN_VOCAB, np.float32)
    for z in logits:
        for sp in cases:
            cand, w = S.sampling_candidates(z, sp, buf)
            got = np.zeros(QWEN_VOCAB)
            if cand is None:
                got = w.astype(np.float64)
            else:
                got[cand] = w
            got /= got.sum()
            want = _reference_probs(z, sp)
            # The kept sets agree up to float32 rounding at the top-p cut (sums accumulate in
            # float32 blocks): tokens there may come or go only with a negligible share.
            differ = (got > 0) != (want > 0)
            assert got[differ].sum() + want[differ].sum() < 1e-5, (sp, differ.sum())
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=str(sp))


def test_top_p_candidate_search_branches(rng):
    """Each way of finding a prefix-closed set holding the top-p mass returns one: the tokens
    near the top, a subsample-estimated threshold, or (estimate fooled) the whole row."""
    target_of = 0.9

    def check(e, want_branch):
        target = target_of * float(e.sum(dtype=np.float64))
        cand, w = S.top_p_candidates(e, float(e.max()), target)
        if want_branch == "all":
            assert cand is None and w is e
            return
        assert cand is not None and float(w.sum(dtype=np.float64)) >= target
        assert e[cand].min() >= e[np.setdiff1d(np.arange(e.shape[0]), cand)].max()
        near_top = bool((e[cand] >= S.TOP_P_PREFILTER * e.max()).all())
        assert near_top == (want_branch == "top")

    peaked = np.full(QWEN_VOCAB, 1e-9, np.float32)
    peaked[[5, 900]] = [1.0, 0.5]
    check(peaked, "top")
    check(np.exp(rng.normal(0, 2, QWEN_VOCAB)).astype(np.float32), "estimate")
    # The mass sits just under the prefilter on positions the stride-16 subsample never sees.
    fooled = np.full(QWEN_VOCAB, 1e-12, np.float32)
    fooled[0] = 1.0
    fooled[np.arange(QWEN_VOCAB) % 16 == 3] = 9e-4
    check(fooled, "all")


def test_full_vocab_draw_distribution():
    # Six tokens spread over the vocabulary (first block, middle, the short last block) hold all
    # but ~1e-8 of the mass; pure temperature sampling draws through the block-wise inverse CDF.
    row = np.full(QWEN_VOCAB, -40.0, np.float32)
    toks = [3, 1500, 77777, 100000, 151600, QWEN_VOCAB - 1]
    row[toks] = np.log([0.3, 0.25, 0.2, 0.1, 0.1, 0.05])
    draws = _draws(row, SamplingParams(temperature=1.0), n=3000)
    assert set(np.unique(draws)) <= set(toks)
    _assert_matches(draws, np.bincount(toks, weights=[0.3, 0.25, 0.2, 0.1, 0.1, 0.05],
                                       minlength=QWEN_VOCAB))


def test_draw_is_the_inverse_cdf(rng):
    for n in (7, 5000, QWEN_VOCAB):
        w = rng.exponential(size=n).astype(np.float32)
        w[rng.random(n) < 0.3] = 0.0
        cum = np.cumsum(w, dtype=np.float64)
        for u in rng.random(20):
            want = int(np.searchsorted(cum, u * cum[-1], side="right"))
            assert S.draw_token(None, w, u) == want
        assert w[S.draw_token(None, w, 0.999999999)] > 0 and w[S.draw_token(None, w, 0.0)] > 0


def test_kth_largest_and_top_indices(rng):
    z = rng.normal(size=QWEN_VOCAB).astype(np.float32)
    srt = np.sort(z)[::-1]
    for k in (1, 5, 20, 64, 1000, 50000, QWEN_VOCAB):
        assert S.kth_largest(z, k) == srt[k - 1]
    np.testing.assert_array_equal(S.top_indices(z, 20), np.argsort(-z, kind="stable")[:20])
    # A subsample that misses the top region still gives the exact answer (fallback).
    z = np.zeros(QWEN_VOCAB, np.float32)
    z[1:200:16] = 1.0  # off the stride-16 subsample
    assert S.kth_largest(z, 13) == 1.0 and S.kth_largest(z, 14) == 0.0


# ---------------------------------------------------------------------------------------------
# Logits processing: bias, min_tokens, penalties


def _reference_processed(raw, row, vocab):
    z = np.array(raw, np.float64)
    p = row.params
    for tok, b in (p.logit_bias or {}).items():
        z[tok] += b
    if len(row.output_token_ids) < p.min_tokens:
        for tok in set(p.stop_token_ids) | set(row.eos_token_ids):
            z[tok] = -np.inf
    for tok in set(row.prompt_token_ids) | set(row.output_token_ids):
        z[tok] = z[tok] / p.repetition_penalty if z[tok] > 0 else z[tok] * p.repetition_penalty
    for tok in set(row.output_token_ids):
        count = list(row.output_token_ids).count(tok)
        z[tok] -= p.frequency_penalty * count + p.presence_penalty
    return z


def test_penalties_bias_and_min_tokens_match_per_row_formula(rng):
    vocab = 300
    rows = []
    for i in range(12):
        sp = SamplingParams(
            temperature=[0, 0.8][i % 2],
            repetition_penalty=float(rng.choice([1.0, 0.7, 1.3, 2.0])),
            frequency_penalty=float(rng.uniform(-2, 2)),
            presence_penalty=float(rng.uniform(-2, 2)),
            logit_bias={int(t): float(rng.normal(0, 3)) for t in rng.integers(0, vocab, 4)},
            min_tokens=int(rng.integers(0, 6)),
            stop_token_ids=[int(t) for t in rng.integers(0, vocab, 2)])
        rows.append(SamplingRow(sp, np.random.default_rng(i),
                                rng.integers(0, vocab, int(rng.integers(0, 30))).tolist(),
                                rng.integers(0, 60, int(rng.integers(0, 10))).tolist(),
                                frozenset({vocab - 1})))
    untouched = SamplingRow(SamplingParams(), np.random.default_rng(0), [1, 2], [3, 3])
    rows.append(untouched)
    logits = rng.normal(0, 3, (len(rows), vocab)).astype(np.float32)
    got = process_logits(logits, rows)
    want = np.stack([_reference_processed(logits[i], r, vocab) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    np.testing.assert_array_equal(sample(logits, rows).token_ids[greedy], want[greedy].argmax(-1))


def test_repetition_penalty_counts_prompt_tokens_frequency_only_outputs():
    raw = np.array([2.0, -2.0, 1.0, 1.0, 0.5], np.float32)
    row = SamplingRow(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5,
                                     presence_penalty=0.25), None, [0, 1], [2, 2, 2])
    np.testing.assert_allclose(process_logits(raw[None], [row])[0],
                               [1.0, -4.0, 0.5 - 1.5 - 0.25, 1.0, 0.5])


def test_logit_bias_forces_a_token(rng):
    logits = rng.normal(0, 3, (3, 500)).astype(np.float32)
    low = int(logits[1].argmin())
    params = [SamplingParams(temperature=0, logit_bias={low: 100.0}),
              SamplingParams(temperature=1.0, logit_bias={low: 100.0}),
              SamplingParams(temperature=2.0, top_p=0.5, logit_bias={low: 100.0, 7: -100.0})]
    assert (sample(logits, _rows(params)).token_ids == low).all()
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias"):
        sample(logits[:1], _rows(SamplingParams(logit_bias={500: 1.0})))


def test_min_tokens_masks_eos_and_stop_ids_then_stops_masking():
    vocab, eos, stop = 50, 49, 7
    logits = np.zeros((1, vocab), np.float32)
    logits[0, eos], logits[0, stop], logits[0, 3] = 10.0, 9.0, 5.0
    for ignore_eos in (False, True):  # vLLM masks eos during min_tokens even with ignore_eos
        sp = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop],
                            ignore_eos=ignore_eos)
        for n_out, want in [(0, 3), (2, 3), (3, eos), (10, eos)]:
            row = SamplingRow(sp, None, [1], [5] * n_out, frozenset({eos}))
            assert sample(logits, [row]).token_ids[0] == want, (n_out, ignore_eos)
    # Random rows never draw a masked id while masking lasts, and do afterwards.
    row = np.log(np.array([0.2, 0.4, 0.4]))
    sp = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[1])
    _assert_matches(_draws(row, sp, n=2000, output=[0], eos=[2]), [1, 0, 0])
    _assert_matches(_draws(row, sp, n=2000, output=[0, 0], eos=[2]), [0.2, 0.4, 0.4])


# ---------------------------------------------------------------------------------------------
# Seeds


def _stream(logit_steps, sp_seed_pairs, index_of_interest, order):
    """Run len(logit_steps) steps of a batch (rows in `order`) and return the token stream of the
    row `index_of_interest`; every row gets a fresh generator from its seed."""
    rows = [SamplingRow(sp, np.random.default_rng(seed), [1, 2, 3], [])
            for sp, seed in sp_seed_pairs]
    stream = []
    for step_logits in logit_steps:
        batch = [rows[j] for j in order]
        out = sample(step_logits[order], batch)
        for pos, j in enumerate(order):
            rows[j].output_token_ids.append(int(out.token_ids[pos]))
        stream.append(int(out.token_ids[order.index(index_of_interest)]))
    return stream


def test_seeded_stream_ignores_batch_company_and_order(rng):
    vocab, steps = 2000, 12
    logit_steps = [rng.normal(0, 2, (5, vocab)).astype(np.float32) for _ in range(steps)]
    pairs = [(SamplingParams(temperature=0.9, top_p=0.95, seed=7), 7),
             (SamplingParams(temperature=0), 0),
             (SamplingParams(temperature=1.5, top_k=20), 99),
             (SamplingParams(temperature=0.7, min_p=0.05, logprobs=2), 5),
             (SamplingParams(temperature=1.0), 11)]
    # Row 0 alone: feed it the same logits rows it sees in the batch.
    alone = _stream([s[[0]] for s in logit_steps], pairs[:1], 0, [0])
    assert _stream(logit_steps, pairs, 0, [0, 1, 2, 3, 4]) == alone
    assert _stream(logit_steps, pairs, 0, [3, 2, 4, 0, 1]) == alone
    assert _stream(logit_steps, pairs, 0, [4, 0]) == alone
    # A different seed gives a different stream (with overwhelming probability).
    other = _stream([s[[0]] for s in logit_steps], [(pairs[0][0], 8)], 0, [0])
    assert other != alone


def test_same_seed_rows_in_one_batch_draw_alike(rng):
    logits = np.broadcast_to(rng.normal(0, 1, 300).astype(np.float32), (4, 300))
    sp = SamplingParams(temperature=1.0, seed=3)
    out = sample(logits, _rows([sp] * 4, seeds=[3, 3, 3, 4]))
    assert out.token_ids[0] == out.token_ids[1] == out.token_ids[2]


# ---------------------------------------------------------------------------------------------
# Logprobs


def _logprob_dicts(out) -> list:
    """The sampler's LogprobsLists rows as the {token: Logprob} dicts users see."""
    return [None if x is None else x.to_dicts()[0] for x in out.logprobs]


def test_logprobs_are_raw_log_softmax_with_ranks(rng):
    vocab = 3000
    logits = rng.normal(0, 3, (4, vocab)).astype(np.float32)
    lowest = int(logits[2].argmin())
    params = [SamplingParams(temperature=0, logprobs=5),
              SamplingParams(temperature=0.6, top_k=10, logprobs=3, repetition_penalty=1.5),
              # Forced to a token far outside the top-N: it comes with its true rank.
              SamplingParams(temperature=1.0, logprobs=4, logit_bias={lowest: 1e4}),
              SamplingParams(temperature=1.0)]
    out = sample(logits, _rows(params, prompt=[1, 2], output=[3]))
    dicts = _logprob_dicts(out)
    ref = log_softmax(logits.astype(np.float64), axis=-1)
    np.testing.assert_allclose(out.sampled_logprobs, ref[np.arange(4), out.token_ids], atol=2e-5)
    assert dicts[3] is None
    for i in range(3):
        n, tok, entries = params[i].logprobs, int(out.token_ids[i]), dicts[i]
        top = np.argsort(-ref[i])[:n]
        for rank, t in enumerate(top, start=1):
            assert entries[int(t)].rank == rank
        assert set(entries) == set(top.tolist()) | {tok}
        for t, lp in entries.items():
            assert isinstance(lp, Logprob) and lp.decoded_token is None
            assert lp.logprob == pytest.approx(ref[i, t], abs=2e-5)
        assert entries[tok].rank == int((ref[i] > ref[i, tok]).sum()) + 1
    assert out.token_ids[2] == lowest and dicts[2][lowest].rank == vocab
    assert len(dicts[2]) == 5


def test_logprobs_zero_and_full_vocab_sum_to_one(rng):
    logits = rng.normal(0, 2, (2, 16)).astype(np.float32)
    out = sample(logits, _rows([SamplingParams(logprobs=0), SamplingParams(logprobs=16)]))
    dicts = _logprob_dicts(out)
    assert list(dicts[0]) == [int(out.token_ids[0])]
    full = dicts[1]
    assert sorted(full) == list(range(16)) and sorted(lp.rank for lp in full.values()) == list(
        range(1, 17))
    assert math.isclose(sum(math.exp(lp.logprob) for lp in full.values()), 1.0, rel_tol=1e-5)


def test_sampled_logprobs_only_where_asked(rng):
    logits = rng.normal(0, 2, (3, 100)).astype(np.float32)
    rows = _rows([SamplingParams(temperature=0), SamplingParams(logprobs=1), SamplingParams()])
    out = sample(logits, rows, all_sampled_logprobs=False)
    assert np.isnan(out.sampled_logprobs[[0, 2]]).all() and np.isfinite(out.sampled_logprobs[1])


def test_logprobs_at_qwen_vocab_and_extreme_logits(rng):
    logits = _llm_like_logits(rng, 2)
    logits[1] += 150.0  # the exp fast path must not overflow
    out = sample(logits, _rows([SamplingParams(temperature=0, logprobs=20),
                                SamplingParams(temperature=0.9, top_p=0.9, logprobs=20)]))
    ref = log_softmax(logits.astype(np.float64), axis=-1)
    np.testing.assert_allclose(out.sampled_logprobs, ref[[0, 1], out.token_ids], atol=5e-5)
    for i in range(2):
        top = np.argsort(-ref[i])[:20]
        assert [_logprob_dicts(out)[i][int(t)].rank for t in top] == list(range(1, 21))


def test_speed_sanity_print(rng):
    rows_n = 64
    logits = _llm_like_logits(rng, rows_n)
    prompt, output = rng.integers(0, QWEN_VOCAB, 500).tolist(), rng.integers(0, QWEN_VOCAB, 100)
    mixes = {
        "greedy": [SamplingParams(temperature=0)],
        "random (T=1)": [SamplingParams()],
        "random (T=.7, top_p=.9)": [SamplingParams(temperature=0.7, top_p=0.9)],
        "mixed": [SamplingParams(temperature=0),
                  SamplingParams(temperature=0.7, top_p=0.9),
                  SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.1),
                  SamplingParams(min_p=0.1, frequency_penalty=0.5, presence_penalty=0.3,
                                 logprobs=5),
                  SamplingParams(temperature=1.2, top_p=0.8, top_k=100, logit_bias={5: 1.0})],
    }
    for name, ps in mixes.items():
        rows = [SamplingRow(ps[i % len(ps)], np.random.default_rng(i), prompt, output.tolist())
                for i in range(rows_n)]
        sample(logits, rows)
        t0 = time.perf_counter()
        sample(logits, rows)
        t1 = time.perf_counter()
        sample(logits, rows, all_sampled_logprobs=False)
        t2 = time.perf_counter()
        print(f"\nsample {rows_n} x {QWEN_VOCAB} {name}: {1e3 * (t1 - t0):.1f} ms "
              f"({1e3 * (t2 - t1):.1f} ms without sampled logprobs)")


def test_penalty_state_updated_per_token_equals_rebuilt(rng):
    from jaxllm.sample.penalties import PenaltyState

    prompt = rng.integers(0, 40, 25).tolist()
    state = PenaltyState(prompt)
    outputs: list[int] = []
    sp = SamplingParams(temperature=0, repetition_penalty=1.7, frequency_penalty=0.6,
                        presence_penalty=-0.4)
    for token in rng.integers(0, 60, 40).tolist():
        state.append(token)
        outputs.append(token)
        fresh = PenaltyState(prompt, outputs)
        for kept, rebuilt in zip(state.arrays()[:2], fresh.arrays()[:2], strict=True):
            np.testing.assert_array_equal(kept, rebuilt)
        assert set(state.arrays()[2].tolist()) == set(prompt) | set(outputs)
        logits = rng.normal(0, 3, (1, 60)).astype(np.float32)
        kept_row = SamplingRow(sp, None, prompt, list(outputs), penalties=state)
        plain_row = SamplingRow(sp, None, prompt, list(outputs))
        np.testing.assert_array_equal(process_logits(logits, [kept_row]),
                                      process_logits(logits, [plain_row]))
