"""The helpers of tests/utils.py that decide what other tests check: check_logprobs_close
accepts what it should and fails on what it should not; the test KV budget is read as set."""

from __future__ import annotations

import pytest

from tests.utils import (
    GPU_TEST_KV_BLOCKS,
    KV_BLOCKS_ENV,
    check_logprobs_close,
    kv_budget_kwargs,
)


def _out(tokens: list[int], tops: list[list[int]]) -> tuple[list[int], list[dict[int, float]]]:
    return tokens, [{t: -float(r) for r, t in enumerate(top)} for top in tops]


def test_identical_outputs_pass():
    a = _out([1, 2, 3], [[1, 9], [2, 9], [3, 9]])
    check_logprobs_close([a], [a])


def test_divergence_inside_each_others_top_k_passes_and_stops_comparing():
    # Token 1 differs (5 vs 6), each in the other's top-k; after it nothing is compared, not
    # even the clearly different tails.
    a = _out([1, 5, 7, 7], [[1], [5, 6], [7], [7]])
    b = _out([1, 6, 8, 8], [[1], [6, 5], [8], [8]])
    check_logprobs_close([a, a], [b, a])


def test_token_outside_the_other_top_k_fails():
    a = _out([1, 5, 7], [[1], [5, 6], [7]])
    b = _out([1, 6, 7], [[1], [6, 4], [7]])  # 5 is not among b's top-k at token 1
    with pytest.raises(AssertionError, match="token 1: a=5, b=6: a's token not in b's top-k"):
        check_logprobs_close([a], [b])
    with pytest.raises(AssertionError, match="b's token not in a's top-k"):
        check_logprobs_close([_out([1, 5, 7], [[1], [5, 4], [7]])],
                             [_out([1, 6, 7], [[1], [6, 5], [7]])])


def test_length_and_count_mismatches_fail():
    a = _out([1, 2], [[1], [2]])
    with pytest.raises(AssertionError, match="2 tokens from a, 1 from b"):
        check_logprobs_close([a], [_out([1], [[1]])])
    with pytest.raises(AssertionError):
        check_logprobs_close([a, a], [a])
    with pytest.raises(AssertionError, match="one logprobs dict per token"):
        check_logprobs_close([([1, 2], [{1: 0.0}])], [a])


def test_kv_budget_from_the_environment(monkeypatch):
    # Unset: the platform's budget on CPU, a small fixed one on a GPU (judged as the engine
    # judges it, from JAX_PLATFORMS or an installed CUDA plugin).
    monkeypatch.delenv(KV_BLOCKS_ENV, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert kv_budget_kwargs() == {}
    monkeypatch.setenv(KV_BLOCKS_ENV, " ")
    assert kv_budget_kwargs() == {}
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert kv_budget_kwargs() == {"num_kv_blocks": GPU_TEST_KV_BLOCKS}
    monkeypatch.setenv(KV_BLOCKS_ENV, "256")
    assert kv_budget_kwargs() == {"num_kv_blocks": 256}
    for bad in ("1", "-4", "lots", "2.5"):
        monkeypatch.setenv(KV_BLOCKS_ENV, bad)
        with pytest.raises(ValueError, match=f"{KV_BLOCKS_ENV} must be an integer >= 2.*{bad!r}"):
            kv_budget_kwargs()
