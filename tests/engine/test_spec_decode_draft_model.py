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
import functools
import gc as garbage_collector

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.config import SpeculativeConfig
from tests.utils import (
    assert_pool_free,
    compile_count,
    core_of,
    make_llm,
    save_tiny_checkpoint,
    scheduler_state,
)

VOCAB = 512
# make_llm's max_model_len.
MAX_MODEL_LEN = 128


def draft_model(path, k: int) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # A larger weight scale than the other engine tests': the greedy output wanders instead
    # of repeating one token, so a poor draft is really rejected.
    path = tmp_path_factory.mktemp("tiny_target")
    save_tiny_checkpoint(path, tied=False, seed=2, initializer_range=0.1)
    return path


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_checkpoint(path, tied=False, seed=7, initializer_range=0.1, num_hidden_layers=1)
    return path


@pytest.fixture(scope="module")
def hf_greedy(model):
    torch = pytest.importorskip(
        "torch", reason="torch (the Hugging Face oracle) is not installed in this test lane")
    import transformers

    hf = transformers.Qwen2ForCausalLM.from_pretrained(str(model)).eval()

    @functools.cache
    def run(prompt: tuple[int, ...], max_new: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                              min_new_tokens=max_new, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    return run


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(42)
    return [rng.integers(0, VOCAB, n).tolist() for n in (24, 17, 30, 9, 3)]


# Few buckets keep start-up short (each engine compiles the target's and the draft's).
SMALL = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)


# In process: some tests read the draft's steps. float32: HF's precision.
@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model, multiprocess_mode=False, **SMALL)


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


def generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def token_ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


class SpecCounters:
    """The core's speculative-decoding counters over a block of the test."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.before = self._read()

    def _read(self) -> dict[str, int]:
        state = scheduler_state(self.llm)
        return {k: state[k] for k in ("num_spec_drafts", "num_spec_draft_tokens",
                                      "num_spec_accepted_tokens")}

    def delta(self) -> dict[str, int]:
        now = self._read()
        return {k: now[k] - self.before[k] for k in now}

    def assert_high(self, rate: float = 0.9) -> dict[str, int]:
        """Drafts were verified and at least `rate` of them accepted (the target drafting for
        itself)."""
        d = self.delta()
        assert d["num_spec_drafts"] > 0, d
        assert d["num_spec_accepted_tokens"] >= rate * d["num_spec_draft_tokens"], d
        assert d["num_spec_accepted_tokens"] <= d["num_spec_draft_tokens"], d
        return d

    def assert_accepted(self) -> dict[str, int]:
        """Drafts were verified and some accepted. (In a step that also carries a prefill
        chunk, drafts beyond the step's logits rows count as rejected even when right: the
        draft log, not this rate, checks a self-draft's tokens in a batch.)"""
        d = self.delta()
        assert d["num_spec_drafts"] > 0 and d["num_spec_accepted_tokens"] > 0, d
        assert d["num_spec_accepted_tokens"] <= d["num_spec_draft_tokens"], d
        return d

    def assert_verified(self) -> dict[str, int]:
        """Drafts were verified and some refused (a random draft)."""
        d = self.delta()
        assert d["num_spec_drafts"] > 0 and d["num_spec_draft_tokens"] >= d["num_spec_drafts"], d
        assert d["num_spec_accepted_tokens"] < d["num_spec_draft_tokens"], d
        return d


@contextlib.contextmanager
def draft_log(llm):
    """Every proposal of an in-process engine's draft model: (prompt, tokens output so far,
    drafts)."""
    drafter = core_of(llm).drafter
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


def assert_same_outputs(got, want) -> None:
    """Spec-on outputs against spec-off ones: tokens, finish and stop reasons."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for gc, wc in zip(g.outputs, w.outputs, strict=True):
            assert (list(gc.token_ids), gc.finish_reason, gc.stop_reason) == \
                (list(wc.token_ids), wc.finish_reason, wc.stop_reason), f"request {i}"


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
RANDOM = dict(temperature=0.8, top_k=50, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(plain, prompts) -> list[list[int]]:
    return token_ids(generate(plain, prompts, GREEDY))


def test_spec_off_equals_hf(plain_greedy, prompts, hf_greedy):
    """The oracle of the greedy tests: the engine without speculation decodes as HF does."""
    for prompt, want in zip(prompts, plain_greedy, strict=True):
        assert want == hf_greedy(tuple(prompt), GREEDY.max_tokens)


def check_greedy_without_recompiles(llm, plain_greedy, prompts) -> SpecCounters:
    counters = SpecCounters(llm)
    before = compile_count(llm)
    outs = generate(llm, prompts, GREEDY)
    assert compile_count(llm) == before, "the engine compiled after warm-up"
    assert token_ids(outs) == plain_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_pool_free(llm)
    return counters


def test_greedy_equals_spec_off_drafting_for_itself(self_spec, plain_greedy, prompts):
    with draft_log(self_spec) as log:
        check_greedy_without_recompiles(self_spec, plain_greedy, prompts).assert_accepted()
    assert_drafts_are_continuations(log, prompts, plain_greedy)


def test_greedy_equals_spec_off_small_draft_multiprocess(small_spec, plain_greedy, prompts):
    check_greedy_without_recompiles(small_spec, plain_greedy, prompts).assert_verified()


def test_one_request_alone_accepts_everything(self_spec, plain_greedy, prompts):
    # Alone, the draft is the target on the same tokens: every draft is its next token.
    counters = SpecCounters(self_spec)
    drafter = core_of(self_spec).drafter
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
    drafter = core_of(tight).drafter
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
    assert_same_outputs(got, want)
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
    want = generate(plain, batch, params)
    counters = SpecCounters(tight)
    preemptions = scheduler_state(tight)["num_preemptions"]
    got = generate(tight, batch, params)
    assert scheduler_state(tight)["num_preemptions"] > preemptions
    assert counters.delta()["num_spec_accepted_tokens"] > 0
    assert_same_outputs(got, want)
    assert_pool_free(tight)


def test_prefix_cache_hits(self_spec, plain):
    rng = np.random.default_rng(5)
    base = rng.integers(0, VOCAB, 70).tolist()
    shared = [base[:48] + rng.integers(0, VOCAB, 5).tolist(),
              base[:50] + rng.integers(0, VOCAB, 12).tolist()]
    want = token_ids(generate(plain, [base] + shared, GREEDY))
    counters = SpecCounters(self_spec)
    assert token_ids(generate(self_spec, [base], GREEDY)) == want[:1]
    outs = generate(self_spec, shared, GREEDY)
    # The target skips the cached blocks; the draft, new to these requests, computes them.
    assert [o.num_cached_tokens for o in outs] == [48, 48]
    assert token_ids(outs) == want[1:]
    counters.assert_accepted()
    assert_pool_free(self_spec)


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
            assert_same_outputs(got, want)
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
        assert_same_outputs(got, want)
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
    want = generate(plain, prompts, params)
    counters = SpecCounters(llm)
    got = generate(llm, prompts, params)
    assert_same_outputs(got, want)
    assert_pool_free(llm)
    d = counters.delta()
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
    engine = self_spec.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    done = {}
    counters = SpecCounters(self_spec)
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            done[o.request_id] = o
        if step == 4:
            engine.abort_request(["r1", "r3"])
    assert set(done) == {"r0", "r2", "r4"}
    for i in (0, 2, 4):
        assert list(done[f"r{i}"].outputs[0].token_ids) == plain_greedy[i]
    # The draft forgets every request, finished or aborted.
    assert core_of(self_spec).drafter._num_computed == core_of(self_spec).drafter._fed == {}
    counters.assert_accepted()
    assert_pool_free(self_spec)


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


# --- the embedded model drafting for itself -----------------------------------------------------

MESSAGES = [{"role": "user", "content": "Write a Python function that returns the n-th "
                                        "Fibonacci number iteratively, with a docstring."}]


@pytest.mark.real_model
def test_embedded_model_drafting_for_itself(real_llm, real_model_path):
    from jaxllm import LLM

    # The oracle is the session's shared engine; the speculative one (target and draft) takes
    # its settings (a small KV array: the draft has one as large) and is dropped at the end.
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = real_llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    want = (list(out.token_ids), out.text)
    llm = LLM(model=str(real_model_path), max_num_seqs=4, max_num_batched_tokens=64,
              show_progress=False, multiprocess_mode=False, dtype="float32", num_kv_blocks=128,
              speculative_config=draft_model(real_model_path, 3))
    try:
        out = llm.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
        got = (list(out.token_ids), out.text)
        state = scheduler_state(llm)
        assert_pool_free(llm)
    finally:
        llm.shutdown()
        del llm
        garbage_collector.collect()
    assert got == want
    assert len(got[0]) == 48
    assert state["num_spec_draft_tokens"] > 0
    # The draft is the target: nearly every draft is its next token.
    assert state["num_spec_accepted_tokens"] > 0.8 * state["num_spec_draft_tokens"], state
