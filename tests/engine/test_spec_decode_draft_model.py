"""Speculative decoding with a draft model end to end.

Two drafts for one tiny target: the target itself (its drafts are the target's own greedy
tokens, so nearly all are accepted) and a one-layer random model of the same vocabulary (its
drafts are mostly rejected). Oracles: the same engine settings without speculation, and Hugging
Face's greedy decoding of the target. Greedy requests must give exactly the spec-off tokens
under chunked catch-up, prefix-cache hits, preemption, stops and length limits; draft tokens are
point masses (the draft's argmax), so a seeded random request draws each token as it would
without them. Every engine test checks through the core's counters that drafts were verified,
so the speculative path really ran.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.config import SpeculativeConfig
from tests.engine import spec_decode_utils
from tests.engine.spec_decode_utils import (
    GREEDY,
    VOCAB,
    SpecCounters,
    draft_model,
    generate,
    token_ids,
)
from tests.utils import (
    assert_pool_free,
    core_of,
    make_llm,
    save_tiny_checkpoint,
    scheduler_state,
)

# make_llm's max_model_len.
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return spec_decode_utils.save_spec_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_checkpoint(path, tied=False, seed=7, initializer_range=0.1, num_hidden_layers=1)
    return path


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(42)
    return [rng.integers(0, VOCAB, n).tolist() for n in (24, 17, 30, 9, 3)]


RANDOM = dict(temperature=0.8, top_k=50, max_tokens=24, ignore_eos=True)
# Few buckets keep start-up short (each engine compiles the target's and the draft's).
SMALL = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)


# In process: some tests read the draft's steps. float32: HF's precision.
@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model, multiprocess_mode=False, **SMALL)


@pytest.fixture(scope="module")
def plain_greedy(plain, prompts) -> list[list[int]]:
    return token_ids(generate(plain, prompts, GREEDY))


@pytest.fixture(scope="module")
def self_spec(model):
    """The target drafting for itself, k = 3."""
    return make_llm(model, multiprocess_mode=False, **SMALL,
                    speculative_config=draft_model(model, 3))


@pytest.fixture(scope="module")
def small_spec(model, small_draft):
    """A one-layer random draft, k = 3; the engine core in its own process."""
    llm = make_llm(model, multiprocess_mode=True, **SMALL,
                   speculative_config=draft_model(small_draft, 3))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tight(model):
    """k = 5, a KV cache small enough to preempt and a token budget (32) smaller than the
    prompts, so the target's prefill and the draft's catch-up both take several steps."""
    return make_llm(model, multiprocess_mode=False, num_kv_blocks=12, **SMALL,
                    speculative_config=draft_model(model, 5))


@contextlib.contextmanager
def draft_log(llm):
    """Every proposal of an in-process engine's draft model: (prompt, tokens output so far,
    drafts)."""
    drafter = core_of(llm).drafter.proposer
    original = drafter.propose
    log: list[tuple[tuple[int, ...], int, list[int]]] = []

    def spy(requests):
        drafts = original(requests)
        log.extend((tuple(r.prompt_token_ids), r.num_output_tokens, d)
                   for r, d in zip(requests, drafts, strict=True))
        return drafts

    drafter.propose = spy
    try:
        yield log
    finally:
        del drafter.propose


def assert_drafts_are_continuations(log, prompts, outputs) -> None:
    """The target drafting for itself proposes, after each output prefix, the greedy tokens
    that follow it (as far as the spec-off output goes): a draft KV cache that missed or
    misplaced a token would show here."""
    want = {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}
    assert log
    for prompt, n, drafts in log:
        assert len(drafts) > 0
        follow = want[prompt][n:n + len(drafts)]
        assert drafts[:len(follow)] == follow, (prompt[:4], n, drafts, follow)


def test_spec_off_equals_hf(model, prompts, plain_greedy):
    spec_decode_utils.assert_spec_off_equals_hf(model, prompts, plain_greedy)


def test_greedy_equals_spec_off_drafting_for_itself(self_spec, plain_greedy, prompts):
    with draft_log(self_spec) as log:
        counters = spec_decode_utils.check_greedy_without_recompiles(self_spec, plain_greedy,
                                                                     prompts)
    counters.assert_accepted()
    assert_drafts_are_continuations(log, prompts, plain_greedy)


def test_greedy_equals_spec_off_small_draft_multiprocess(small_spec, plain_greedy, prompts):
    counters = spec_decode_utils.check_greedy_without_recompiles(small_spec, plain_greedy, prompts)
    counters.assert_verified()


def test_one_request_alone_accepts_everything(self_spec, plain_greedy, prompts):
    # Alone, the draft is the target on the same tokens: every draft is its next token.
    counters = SpecCounters(self_spec)
    drafter = core_of(self_spec).drafter.proposer
    fed = []
    original = drafter.runner.execute_model

    def spy(so, *args, **kwargs):
        fed.append(so.total_num_scheduled_tokens)
        return original(so, *args, **kwargs)

    drafter.runner.execute_model = spy
    try:
        assert token_ids(generate(self_spec, [prompts[0]], GREEDY)) == [plain_greedy[0]]
    finally:
        del drafter.runner.execute_model
    d = counters.assert_high(rate=1.0)
    # k = 3: each verifying step emits 4 tokens; 24 tokens = the prefill's, then 23 more.
    assert d["num_spec_drafts"] == -(-(GREEDY.max_tokens - 1) // 4)
    # Each proposal: a catch-up, then 2 decode steps of one token. After the first, a
    # catch-up feeds only the last draft and the bonus token: the 2 drafts its decode steps
    # fed were accepted, and their KV is kept.
    proposals = [fed[i:i + 3] for i in range(0, len(fed), 3)]
    # The first: the prompt and the token its prefill sampled.
    assert len(proposals) == d["num_spec_drafts"] and proposals[0][0] == len(prompts[0]) + 1
    assert all(p == [2, 1, 1] for p in proposals[1:]), proposals


def test_catch_up_in_chunks_under_preemption(tight, plain):
    """Prompts longer than the token budget: the draft's catch-up on them runs in several
    steps; the 11 usable blocks cannot hold every request to the end, so some are preempted,
    resumed, and caught up again from their first token."""
    rng = np.random.default_rng(3)
    long_prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in (70, 45, 52, 38)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = generate(plain, long_prompts, params)
    drafter = core_of(tight).drafter.proposer
    steps = []
    original = drafter.runner.execute_model

    def spy(so, *args, **kwargs):
        steps.append([(r.num_tokens, r.do_sample) for r in so.scheduled])
        return original(so, *args, **kwargs)

    drafter.runner.execute_model = spy
    try:
        counters = SpecCounters(tight)
        preemptions = scheduler_state(tight)["num_preemptions"]
        with draft_log(tight) as log:
            got = generate(tight, long_prompts, params)
    finally:
        del drafter.runner.execute_model
    assert_drafts_are_continuations(log, long_prompts, token_ids(want))
    spec_decode_utils.assert_same_outputs(got, want)
    assert scheduler_state(tight)["num_preemptions"] > preemptions
    counters.assert_high()
    # The draft's catch-up chunks: some stop short of a request's end (no token sampled),
    # none exceeds the budget.
    assert any(not do_sample for step in steps for _, do_sample in step)
    assert max(sum(n for n, _ in step) for step in steps) <= 32
    assert_pool_free(tight)


def test_seeded_n2_under_preemption_equals_spec_off(tight, plain, prompts):
    batch = [(p * 3)[:40] for p in prompts[:3]]
    params = SamplingParams(n=2, seed=41, **dict(RANDOM, max_tokens=40))
    preemptions = scheduler_state(tight)["num_preemptions"]
    counters = spec_decode_utils.check_equals_spec_off(tight, plain, batch, params)
    assert scheduler_state(tight)["num_preemptions"] > preemptions
    assert counters.delta()["num_spec_accepted_tokens"] > 0


def test_prefix_cache_hits(self_spec, plain):
    # The target skips the cached blocks; the draft, new to these requests, computes them.
    base = np.random.default_rng(6).integers(0, VOCAB, 70).tolist()
    counters = spec_decode_utils.check_prefix_cache_hits(self_spec, plain, base)
    counters.assert_accepted()


def test_max_tokens_inside_an_accepted_run(self_spec, plain_greedy, prompts):
    lengths = list(range(1, 14))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    counters = SpecCounters(self_spec)
    outs = generate(self_spec, [prompts[1]] * len(lengths), params)
    for m, o in zip(lengths, outs, strict=True):
        assert (list(o.outputs[0].token_ids), o.outputs[0].finish_reason) == \
            (plain_greedy[1][:m], "length"), m
    counters.assert_accepted()
    assert_pool_free(self_spec)


def test_stop_token_ids(self_spec, plain, prompts, plain_greedy):
    """A stop token inside the output ends generation on it, as without drafts, also where it
    arrives with accepted drafts after it in the same step."""
    counters = SpecCounters(self_spec)
    checked = 0
    for prompt, out in zip(prompts[:3], plain_greedy[:3], strict=True):
        fresh = [j for j in range(2, len(out)) if out[j] not in out[:j]][:3]
        for pos in fresh:
            params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[out[pos]])
            want = generate(plain, [prompt], params)
            got = generate(self_spec, [prompt], params)
            assert (list(got[0].outputs[0].token_ids), got[0].outputs[0].finish_reason,
                    got[0].outputs[0].stop_reason) == (out[:pos + 1], "stop", out[pos])
            spec_decode_utils.assert_same_outputs(got, want)
            checked += 1
    assert checked >= 6
    counters.assert_accepted()
    assert_pool_free(self_spec)


def test_near_max_model_len(self_spec, plain):
    """Past max_model_len - k no drafts are proposed (no room for the lookahead); requests
    still run to max_model_len with the spec-off tokens."""
    rng = np.random.default_rng(9)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for n, drafts in ((MAX_MODEL_LEN - 12, True), (MAX_MODEL_LEN - 2, False)):
        prompt = rng.integers(0, VOCAB, n).tolist()
        want = generate(plain, [prompt], params)
        counters = SpecCounters(self_spec)
        got = generate(self_spec, [prompt], params)
        spec_decode_utils.assert_same_outputs(got, want)
        assert len(got[0].outputs[0].token_ids) == MAX_MODEL_LEN - n
        assert got[0].outputs[0].finish_reason == "length"
        d = counters.delta()
        if drafts:
            counters.assert_high()
            # The last drafts end where the lookahead meets max_model_len.
            assert d["num_spec_draft_tokens"] < MAX_MODEL_LEN - n
        else:
            assert d["num_spec_draft_tokens"] == 0, d
    assert_pool_free(self_spec)


def check_seeded_sampling(llm, plain, prompts) -> dict[str, int]:
    params = [SamplingParams(seed=21 + i, **kw) for i, kw in enumerate([
        RANDOM, dict(RANDOM, temperature=1.0, top_k=-1), dict(RANDOM, top_p=0.8),
        dict(RANDOM, min_p=0.05, repetition_penalty=1.2), dict(RANDOM, temperature=0.3)])]
    d = spec_decode_utils.check_equals_spec_off(llm, plain, prompts, params).delta()
    assert d["num_spec_drafts"] > 0, d
    return d


def test_seeded_sampling_equals_spec_off_drafting_for_itself(self_spec, plain, prompts):
    """Draft tokens are point masses: each emitted token takes one draw from the request's
    generator, drafts or not, so a seeded request gives the spec-off engine's tokens."""
    d = check_seeded_sampling(self_spec, plain, prompts)
    assert d["num_spec_accepted_tokens"] > 0, d


def test_seeded_sampling_equals_spec_off_small_draft(small_spec, plain, prompts):
    check_seeded_sampling(small_spec, plain, prompts)


def test_aborts_mid_run_leave_every_block_free(self_spec, prompts, plain_greedy):
    counters = spec_decode_utils.check_aborts_mid_run(self_spec, prompts, plain_greedy)
    # The draft forgets every request, finished or aborted.
    proposer = core_of(self_spec).drafter.proposer
    assert proposer.tracked_request_ids == set()
    counters.assert_accepted()


# --- refusals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    ({"method": "draft_model", "num_speculative_tokens": 3},
     r"speculative_config: method 'draft_model' needs 'model'.*None"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""},
     r"speculative_config: method 'draft_model' needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": 5},
     r"speculative_config: method 'draft_model' needs 'model'.*5"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "/some/draft"},
     r"speculative_config: method 'ngram' takes no 'model'.*/some/draft"),
    ({"method": "ngram", "num_speculative_tokens": 3, "revision": "v1"},
     r"speculative_config: method 'ngram' takes no 'model' or 'revision'.*v1"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": "o/m", "revision": 1},
     r"speculative_config.revision must be a branch, tag or commit.*got 1"),
])
def test_config_refusals(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(value)


def test_draft_model_config_parses():
    config = SpeculativeConfig.from_dict(
        '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 4}')
    assert (config.method, config.model, config.num_speculative_tokens) == \
        ("draft_model", "/d", 4)


@pytest.mark.parametrize("kind", ["vocab", "positions", "missing"])
def test_draft_refused_by_the_engine(kind, model, tmp_path):
    draft = tmp_path / "draft"
    if kind == "vocab":
        save_tiny_checkpoint(draft, tied=False, vocab_size=VOCAB + 64, num_hidden_layers=1)
        match = r"speculative_config\.model .*draft.* vocabulary of 576 tokens, the target 512"
    elif kind == "positions":
        save_tiny_checkpoint(draft, tied=False, num_hidden_layers=1,
                             max_position_embeddings=MAX_MODEL_LEN // 2)
        match = r"speculative_config\.model .*draft.* handles 64 positions, fewer than " \
                r"max_model_len=128"
    else:
        match = r"speculative_config\.model .*draft.*: .*draft: no such file or directory"
    with pytest.raises(ValueError, match=match):
        make_llm(model, dtype="float32", multiprocess_mode=False, max_num_seqs=1,
                 max_num_batched_tokens=8, speculative_config=draft_model(draft, 2))


def test_a_windowed_target_frees_nothing_under_a_draft(tmp_path, small_draft, prompts):
    """Every layer of the target slides over 16 keys: alone, its blocks behind the window go
    back to the pool; with a draft model, whose full attention reads the target's block tables,
    none may (the scheduler gets no window), and greedy tokens stay the spec-off ones."""
    save_tiny_checkpoint(tmp_path, tied=False, seed=3, arch="mistral", sliding_window=16)
    long_prompts = [p * 3 for p in prompts[:3]]  # 72, 51, 90 tokens: far past the window
    plain = make_llm(tmp_path, multiprocess_mode=False, **SMALL)
    try:
        assert plain.llm_engine.describe()["kv_cache_groups"] == [16]
        want = token_ids(generate(plain, long_prompts, GREEDY))
    finally:
        plain.shutdown()
    llm = make_llm(tmp_path, multiprocess_mode=False, **SMALL,
                   speculative_config=draft_model(small_draft, 3))
    try:
        assert llm.llm_engine.describe()["kv_cache_groups"] == [None]
        counters = SpecCounters(llm)
        assert token_ids(generate(llm, long_prompts, GREEDY)) == want
        assert counters.delta()["num_spec_drafts"] > 0
        assert_pool_free(llm)
    finally:
        llm.shutdown()
