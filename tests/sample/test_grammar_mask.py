"""Structured-output masks in the host sampler: the masked top-K candidates against the
full-row sampler on the masked row (the oracle), and raw logprobs.

Masks are built here with numpy's packbits (bit t of a row = token t allowed, llguidance's
layout), independently of the sampler's bit tests and unpacking.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.sample.candidates import TopKLogits, exact_rows, mask_candidates, sample_from_topk
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.sampler import SamplingRow, sample
from jaxllm.sample.token_mask import TokenMask
from jaxllm.sampling_params import SamplingParams
from tests.sampling_cases import device_topk, llm_like, param_mix


def pack(allowed: np.ndarray) -> np.ndarray:
    """[R, vocab] bool -> [R, ceil(vocab / 32)] int32 bit rows."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view(np.int32)


def crafted_masks(rng, topk: TopKLogits, vocab: int) -> np.ndarray:
    """Per row one of: a sparse random set; everything but the top candidates; only tokens
    outside the candidates (no candidate allowed); a few candidates deep in the list plus a
    random tail; everything."""
    rows = len(topk.values)
    allowed = np.zeros((rows, vocab), bool)
    for r in range(rows):
        ids = topk.token_ids[r]
        kind = r % 5
        if kind == 0:
            allowed[r] = rng.random(vocab) < 0.1
        elif kind == 1:
            allowed[r] = True
            allowed[r, ids[:int(rng.integers(1, 6))]] = False
        elif kind == 2:
            allowed[r] = rng.random(vocab) < 0.3
            allowed[r, ids] = False
        elif kind == 3:
            allowed[r] = rng.random(vocab) < 0.01
            allowed[r, ids] = False
            allowed[r, rng.choice(ids[len(ids) // 2:], 3, replace=False)] = True
        else:
            allowed[r] = True
    return allowed


def test_masked_candidates_sample_what_the_masked_full_row_samples(rng):
    vocab, rows = 5000, 60
    checked = 0
    for trial in range(4):
        x = llm_like(rng, rows, vocab, spread=[0.5, 2.0, 3.0, 1.0][trial])
        params = param_mix(rng, rows)
        topk = device_topk(x)
        allowed = crafted_masks(rng, topk, vocab)
        bitmask = pack(allowed)
        everything = np.arange(rows)
        masked = mask_candidates(topk, everything, bitmask)
        metadata = SamplingMetadata.from_params(params)
        exact = exact_rows(metadata, np.zeros(rows, bool), topk, masked)
        for r in range(rows):
            if not allowed[r, topk.token_ids[r]].any():
                assert not exact[r]  # no allowed candidate: only the full row knows
        assert exact.sum() >= rows // 4
        gens = [np.random.default_rng(p.seed) for p in params]
        u = np.array([0.0 if p.greedy else g.random() for p, g in zip(params, gens, strict=True)])
        # The oracle: every row through the full-row sampler on its masked row.
        want = sample(x, [SamplingRow(p, None, mask=TokenMask.from_allowed(allowed[r], vocab))
                          for r, p in enumerate(params)], lse=topk.lse, u=u)
        assert allowed[everything, want.token_ids].all()
        fast = np.flatnonzero(exact)
        tokens, sampled_lp, logprobs = sample_from_topk(
            topk.rows(fast), metadata.rows(fast), u[fast], masked.rows(fast))
        assert allowed[fast, tokens].all()  # the candidate path never picks a masked token
        np.testing.assert_array_equal(tokens, want.token_ids[fast])
        np.testing.assert_array_equal(sampled_lp, want.sampled_logprobs[fast])
        assert logprobs == [want.logprobs[i] for i in fast]
        # Logprobs are the raw distribution's, not the masked one's.
        np.testing.assert_allclose(
            sampled_lp, x[fast, tokens] - topk.lse[fast], rtol=1e-5, atol=1e-5)
        checked += fast.size
    assert checked >= 60


def test_greedy_masked_row_outside_the_candidates_takes_the_full_row(rng):
    vocab = 3000
    x = llm_like(rng, 2, vocab)
    topk = device_topk(x)
    allowed = np.zeros((2, vocab), bool)
    outside = np.setdiff1d(np.arange(vocab), topk.token_ids[0])[:5]
    allowed[0, outside] = True  # only tokens below every candidate
    allowed[1, topk.token_ids[1][3]] = True  # one candidate, the 4th best
    params = [SamplingParams(temperature=0.0, logprobs=2)] * 2
    metadata = SamplingMetadata.from_params(params)
    masked = mask_candidates(topk, np.arange(2), pack(allowed))
    exact = exact_rows(metadata, np.zeros(2, bool), topk, masked)
    assert exact.tolist() == [False, True]
    want = sample(x, [SamplingRow(p, None, mask=TokenMask.from_allowed(allowed[r], vocab))
                      for r, p in enumerate(params)], lse=topk.lse)
    assert want.token_ids[0] == outside[np.argmax(x[0, outside])]
    assert want.token_ids[1] == topk.token_ids[1][3]
    tokens, _, logprobs = sample_from_topk(topk.rows(np.array([1])), metadata.rows(np.array([1])),
                                           np.zeros(1), masked.rows(np.array([1])))
    assert tokens.tolist() == [topk.token_ids[1][3]]
    # Raw logprob rows: the sampled token at its raw rank 4, then the raw top 2.
    row = logprobs[0]
    assert row.ranks == [[4, 1, 2]]
    assert row.token_ids == [[int(topk.token_ids[1][3])] + topk.token_ids[1][:2].tolist()]
    assert logprobs == [want.logprobs[1]]


def test_unconstrained_rows_are_untouched_by_mask_candidates(rng):
    x = llm_like(rng, 4, 2000)
    topk = device_topk(x)
    allowed = np.zeros((1, 2000), bool)
    allowed[0, ::7] = True
    masked = mask_candidates(topk, np.array([2]), pack(allowed))
    for r in (0, 1, 3):
        np.testing.assert_array_equal(masked.values[r], topk.values[r])
        np.testing.assert_array_equal(masked.token_ids[r], topk.token_ids[r])
    keep = allowed[0, topk.token_ids[2]]
    assert np.isfinite(masked.values[2]).sum() == keep.sum()
    np.testing.assert_array_equal(masked.values[2, :keep.sum()], topk.values[2][keep])
    np.testing.assert_array_equal(masked.token_ids[2, :keep.sum()], topk.token_ids[2][keep])


@pytest.mark.parametrize("density", [0.0005, 0.3, 0.7, 0.9995])
def test_token_mask_from_bitmask_applies_exactly_the_grammar_mask(rng, density):
    """Either form (allowed ids or masked ids, whichever is shorter) gives the row the bool mask
    gives, from llguidance's bit layout; tokens past the vocabulary the mask knows are masked,
    and bits past the row's width are ignored."""
    vocab = 5000
    allowed = rng.random(vocab) < density
    allowed[int(rng.integers(vocab))] = True
    mask = TokenMask.from_bitmask(pack(allowed[None])[0], vocab)
    assert mask.keep == (density < 0.5)
    assert mask.ids.size == (allowed.sum() if mask.keep else (~allowed).sum())
    raw = rng.normal(0, 3, vocab + 7).astype(np.float32)  # logits wider than the mask's vocab
    want = np.where(np.append(allowed, np.zeros(7, bool)), raw, np.float32(-np.inf))
    np.testing.assert_array_equal(mask.apply(raw), want)
    np.testing.assert_array_equal(mask.apply(raw[:vocab - 3]), want[:vocab - 3])
    assert mask.apply(raw).dtype == np.float32
