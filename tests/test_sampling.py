"""SamplingParams validation and the host sampler's statistics."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.sampler import sample
from jaxllm.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"seed": "x"}, "seed"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="END", top_k=0)
    assert sp.stop == ["END"] and sp.top_k == -1 and sp.stop_token_ids == []
    assert SamplingParams(temperature=0).greedy


def _logits(rng, rows=3, vocab=1000):
    return rng.normal(0, 3, size=(rows, vocab)).astype(np.float32)


def test_greedy_and_top_k_1_are_argmax(rng):
    logits = _logits(rng)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1),
              SamplingParams(temperature=0.7, top_k=1, top_p=0.5)]
    gens = [np.random.default_rng(i) for i in range(3)]
    np.testing.assert_array_equal(sample(logits, params, gens), logits.argmax(-1))


def test_seeded_rows_ignore_batch_company(rng):
    logits = _logits(rng, rows=3)
    sp = SamplingParams(temperature=1.0, seed=7)
    alone = sample(logits[1:2], [sp], [np.random.default_rng(7)])[0]
    mixed = sample(logits, [SamplingParams(temperature=0.3), sp, SamplingParams(temperature=2.0)],
                   [np.random.default_rng(99), np.random.default_rng(7),
                    np.random.default_rng(5)])
    assert mixed[1] == alone


def _empirical(row, sp, n=4000):
    gen = np.random.default_rng(123)
    draws = [sample(row[None], [sp], [gen])[0] for _ in range(n)]
    return np.bincount(draws, minlength=row.shape[0]) / n


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_distribution_matches_softmax():
    row = np.log(np.array([0.5, 0.25, 0.15, 0.1], np.float32))
    freq = _empirical(row, SamplingParams(temperature=2.0))
    want = _softmax(row / 2.0)
    # 4000 draws: standard error <= 0.008, so 0.03 is ~4 sigma.
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    freq = _empirical(row, SamplingParams(temperature=1.0, top_p=0.7))
    # 0.5 < 0.7 <= 0.8: the top two survive, renormalised to 5/8 and 3/8.
    assert freq[2] == 0 and freq[3] == 0
    np.testing.assert_allclose(freq[:2], [0.625, 0.375], atol=0.03)


def test_top_k_and_min_p_cut_the_tail():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    freq = _empirical(row, SamplingParams(temperature=1.0, top_k=3), n=2000)
    assert freq[3] == 0 and freq[2] > 0
    freq = _empirical(row, SamplingParams(temperature=1.0, min_p=0.6), n=2000)
    # min_p 0.6 of the top prob 0.4 = 0.24: only tokens 0 and 1 stay.
    assert freq[2] == 0 and freq[3] == 0
    np.testing.assert_allclose(freq[:2], [4 / 7, 3 / 7], atol=0.04)
