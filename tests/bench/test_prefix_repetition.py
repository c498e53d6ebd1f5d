"""`jaxllm bench serve --dataset-name prefix_repetition` (vLLM's dataset): prompt lengths,
which prompts share a prefix, the shuffled order, and determinism by seed."""

from __future__ import annotations

from collections import Counter

import pytest

from jaxllm.benchmarks.datasets import TokenSampler, prefix_repetition_workload
from jaxllm.benchmarks.serve import build_workload
from jaxllm.entrypoints.cli.main import build_parser

PREFIX, SUFFIX = 24, 5


def _workload(num_prompts=40, num_prefixes=4, seed=0, output_len=3):
    sampler = TokenSampler(1000, special_ids={0, 999})
    return prefix_repetition_workload(sampler, num_prompts, PREFIX, SUFFIX, num_prefixes,
                                      output_len, seed)


def test_lengths_and_shared_prefixes():
    wl = _workload()
    assert len(wl) == 40
    assert wl.prompt_lens == [PREFIX + SUFFIX] * 40 and wl.output_lens == [3] * 40
    assert all(0 < t < 999 for p in wl.prompts for t in p)  # special ids left out
    prefixes = Counter(tuple(p[:PREFIX]) for p in wl.prompts)
    assert sorted(prefixes.values()) == [10, 10, 10, 10]
    # Each prompt goes on with a suffix of its own.
    assert len({tuple(p[PREFIX:]) for p in wl.prompts}) == 40
    # Interleaved: the first ten prompts are not one prefix's group.
    assert len({tuple(p[:PREFIX]) for p in wl.prompts[:10]}) > 1
    assert wl.summary()["total_prompt_tokens"] == 40 * (PREFIX + SUFFIX)


def test_seeded():
    assert _workload(seed=5).prompts == _workload(seed=5).prompts
    assert _workload(seed=5).prompts != _workload(seed=6).prompts


def test_prompts_per_prefix_round_down_like_vllm():
    wl = _workload(num_prompts=11, num_prefixes=3)
    assert len(wl) == 9
    assert sorted(Counter(tuple(p[:PREFIX]) for p in wl.prompts).values()) == [3, 3, 3]
    with pytest.raises(ValueError, match="at least"):
        _workload(num_prompts=2, num_prefixes=3)
    with pytest.raises(ValueError, match="num-prefixes"):
        _workload(num_prefixes=0)


class _Tokenizer:
    all_special_ids = [0]
    added_tokens_decoder = {99: "<x>"}

    def __len__(self):
        return 100

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_bench_serve_flags_build_the_workload():
    args = build_parser().parse_args([
        "bench", "serve", "--dataset-name", "prefix_repetition", "--num-prompts", "12",
        "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
        "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "7",
        "--seed", "2"])
    reqs = build_workload(args, _Tokenizer())
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(20, 7)] * 12
    assert all(isinstance(r.prompt, list) and 0 not in r.prompt and 99 not in r.prompt
               for r in reqs)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 3
    assert [r.prompt for r in build_workload(args, _Tokenizer())] == [r.prompt for r in reqs]
    # The chat endpoint sends the ids' text.
    args.endpoint = "/v1/chat/completions"
    chat = build_workload(args, _Tokenizer())
    assert [r.prompt for r in chat] == [" ".join(map(str, r.prompt)) for r in reqs]
    # vLLM's defaults.
    d = build_parser().parse_args(["bench", "serve", "--dataset-name", "prefix_repetition"])
    assert (d.prefix_repetition_prefix_len, d.prefix_repetition_suffix_len,
            d.prefix_repetition_num_prefixes, d.prefix_repetition_output_len) == (256, 256, 10,
                                                                                   128)
