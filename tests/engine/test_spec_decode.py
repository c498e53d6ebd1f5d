"""Speculative decoding (n-gram prompt lookup) end to end.

Oracles: the same engine settings without speculation, and Hugging Face's greedy decoding of the
same checkpoint. Greedy requests must give exactly the tokens, logprobs, finish reasons and text
they give without drafts, under preemption, chunked prefill, prefix-cache hits, stops, length
limits and structured outputs. N-gram drafts are point masses, so a seeded random request draws
each token as it would without them: its tokens are the spec-off engine's too, in any batch.
Every engine test checks through the core's counters that drafts were verified and some
accepted, so the speculative path really ran.

The tiny checkpoint here is initialised with a larger weight scale than the other engine tests'
(whose greedy output repeats one token): its greedy output wanders and falls into short cycles,
so prompt lookup proposes runs that are partly accepted and partly rejected.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.config import SpeculativeConfig, resolve_async_scheduling
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from tests.engine import spec_decode_utils
from tests.engine.spec_decode_utils import GREEDY, VOCAB, SpecCounters, generate, ngram, token_ids
from tests.utils import (
    assert_pool_free,
    check_logprobs_close,
    make_llm,
    on_each_step,
    scheduler_state,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return spec_decode_utils.save_spec_target(tmp_path_factory.mktemp("tiny_spec"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts with repeats (lookup finds drafts in the prompt) and without (only the output's
    own cycles give drafts)."""
    rng = np.random.default_rng(42)
    pat = rng.integers(0, VOCAB, 6).tolist()
    return [pat * 4,
            rng.integers(0, VOCAB, 17).tolist(),
            list(range(20, 30)) * 3,
            (pat[:3] + [5]) * 5 + rng.integers(0, VOCAB, 9).tolist(),
            rng.integers(0, VOCAB, 3).tolist()]


# In process: the chunked-prefill check reads each step's schedule. float32: HF's precision.
@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model, dtype="float32", multiprocess_mode=False)


@pytest.fixture(scope="module")
def spec(model):
    # Top-K candidate sampling (the GPU default): rows without drafts are sampled from the
    # device's candidates in the same steps as the verified ones.
    return make_llm(model, dtype="float32", multiprocess_mode=False, topk_sampling=True,
                    speculative_config=ngram(3))


@pytest.fixture(scope="module")
def spec_tight(model):
    """k = 5, a KV cache small enough to preempt and a token budget small enough to chunk; the
    largest spec-decode bucket (4 x 6 tokens) holds fewer sequences than may run (8)."""
    return make_llm(model, dtype="float32", multiprocess_mode=False, num_kv_blocks=12,
                    max_num_seqs=8, max_num_batched_tokens=32, speculative_config=ngram(5))


RANDOM = dict(temperature=0.3, top_k=50, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(plain, prompts) -> list[list[int]]:
    return token_ids(generate(plain, prompts, GREEDY))


def test_spec_off_equals_hf(model, prompts, plain_greedy):
    spec_decode_utils.assert_spec_off_equals_hf(model, prompts, plain_greedy)


def test_greedy_equals_spec_off(spec, plain_greedy, prompts):
    spec.collective_rpc("reset_step_shape_counts")
    counters = spec_decode_utils.check_greedy_without_recompiles(spec, plain_greedy, prompts)
    counters.assert_exercised()
    # Steps of the spec-decode shape ran: 1 + k tokens per sequence.
    shapes = spec.collective_rpc("get_step_shape_counts")
    assert any(q == 4 for _, q, _ in shapes), shapes


def test_one_request_alone(spec, plain_greedy, prompts):
    # Alone: every step is a spec-decode step of one sequence.
    for i in (0, 2):
        counters = SpecCounters(spec)
        assert token_ids(generate(spec, [prompts[i]], GREEDY)) == [plain_greedy[i]]
        counters.assert_exercised(rejected=False)
    assert_pool_free(spec)


def test_preemption_and_chunked_prefill(spec_tight, plain, prompts):
    rng = np.random.default_rng(3)
    # Long prompts with repeats: prefills take several 32-token chunks and the 11 usable
    # blocks of 16 tokens cannot hold every request to the end.
    long_prompts = [(p * 8)[:int(n)] for p, n in zip(prompts, rng.integers(40, 60, 5),
                                                     strict=True)]
    kinds = [dict(prompt_logprobs=2, logprobs=2), dict(repetition_penalty=1.3, logprobs=1),
             dict(min_tokens=10, stop_token_ids=[432, 367]), {},
             dict(frequency_penalty=0.4, prompt_logprobs=1)]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, **kind)
              for kind in kinds]
    want = generate(plain, long_prompts, params)
    steps = []
    on_each_step(spec_tight, lambda so: steps.append(
        [(r.num_tokens, r.do_sample, r.num_draft_tokens) for r in so.scheduled]))
    counters = SpecCounters(spec_tight)
    preemptions = scheduler_state(spec_tight)["num_preemptions"]
    spec_decode_utils.assert_same_outputs(generate(spec_tight, long_prompts, params), want)
    assert scheduler_state(spec_tight)["num_preemptions"] > preemptions
    # Chunked: some steps computed part of a prompt (no token sampled); the budget held,
    # drafts included.
    assert any(not do_sample for step in steps for _, do_sample, _ in step)
    assert max(sum(n for n, _, _ in step) for step in steps) <= 32
    assert max(d for step in steps for _, _, d in step) == 5
    counters.assert_exercised()
    assert_pool_free(spec_tight)


def test_seeded_n2_under_preemption_equals_spec_off(spec_tight, plain, prompts):
    """n = 2 children share their prompt's blocks, accept different drafts and are preempted
    and resumed through the prefix cache: each resumes on its own KV, so the tokens are the
    spec-off engine's."""
    batch = [(p * 4)[:30] for p in prompts[:4]]
    params = SamplingParams(n=2, seed=41, **dict(RANDOM, max_tokens=40))
    preemptions = scheduler_state(spec_tight)["num_preemptions"]
    counters = spec_decode_utils.check_equals_spec_off(spec_tight, plain, batch, params)
    assert scheduler_state(spec_tight)["num_preemptions"] > preemptions
    counters.assert_exercised()


def test_prefix_cache_hits(spec, plain, prompts):
    counters = spec_decode_utils.check_prefix_cache_hits(spec, plain, (prompts[3] * 3)[:70])
    counters.assert_exercised(rejected=False)


def test_output_blocks_filled_by_drafts_are_prefix_cached(spec, plain, prompts):
    """A follow-up prompt made of a request's prompt and output (a chat's next turn) hits the
    blocks the output filled, accepted drafts included, as many as without speculation."""
    rng = np.random.default_rng(8)
    pattern = rng.integers(0, VOCAB, 7).tolist()
    first = pattern * 3  # new to both engines' caches
    params = SamplingParams(temperature=0.0, max_tokens=44, ignore_eos=True)
    hits = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        counters = SpecCounters(llm) if llm is spec else None
        out = generate(llm, [first], params)[0].outputs[0]
        follow = first + list(out.token_ids)[:40] + [7, 8, 9]
        again = generate(llm, [follow], GREEDY)[0]
        hits[name] = (list(out.token_ids), again.num_cached_tokens,
                      list(again.outputs[0].token_ids))
        if counters is not None:
            counters.assert_exercised(rejected=False)
    assert hits["spec"] == hits["plain"]
    assert hits["plain"][1] == (len(first) + 40) // 16 * 16
    assert_pool_free(spec)


def test_max_tokens_inside_an_accepted_run(spec, plain, prompts):
    """Every length from 2 to 20: a run of accepted drafts that would overshoot it is cut by
    the scheduler (drafts beyond max_tokens are never proposed to the step)."""
    lengths = list(range(2, 21))
    batch = [prompts[0]] * len(lengths)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    want = token_ids(generate(plain, [prompts[0]], SamplingParams(
        temperature=0.0, max_tokens=max(lengths), ignore_eos=True)))[0]
    counters = SpecCounters(spec)
    outs = generate(spec, batch, params)
    for m, o in zip(lengths, outs, strict=True):
        assert o.outputs[0].token_ids == want[:m], m
        assert o.outputs[0].finish_reason == "length"
    counters.assert_exercised(rejected=False)
    assert_pool_free(spec)


def stop_positions(prompt: list[int], out: list[int]) -> list[int]:
    """Output positions whose token is new to the output: one at 6 or later, and the first
    past position 1 that also occurs in the prompt (lookup can draft it, so it may arrive
    inside a run of accepted drafts)."""
    fresh = [j for j in range(1, len(out)) if out[j] not in out[:j]]
    late = [j for j in fresh if j >= 6][:1]
    drafted = [j for j in fresh if out[j] in prompt][:1]
    return sorted(set(late + drafted))


def test_stop_token_ids(spec, plain, prompts, plain_greedy):
    """A stop token id in the middle of the output: generation ends on it, as without drafts,
    even where it arrives with accepted drafts after it in the same step."""
    counters = SpecCounters(spec)
    checked = 0
    for prompt, want_all in zip(prompts, plain_greedy, strict=True):
        for pos in stop_positions(prompt, want_all):
            params = SamplingParams(temperature=0.0, max_tokens=24,
                                    stop_token_ids=[want_all[pos]])
            want = generate(plain, [prompt], params)[0].outputs[0]
            got = generate(spec, [prompt], params)[0].outputs[0]
            assert list(want.token_ids) == want_all[:pos + 1]
            assert (list(got.token_ids), got.finish_reason, got.stop_reason) == \
                (list(want.token_ids), "stop", want_all[pos])
            checked += 1
    assert checked >= 4
    counters.assert_exercised()
    assert_pool_free(spec)


def test_processed_greedy_rows_equal_spec_off(spec, plain, prompts):
    """Penalties, logit_bias and min_tokens see the drafts before each verified position as
    output; prompt logprobs are unchanged; max_tokens None runs to max_model_len."""
    kinds = [dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1),
             dict(repetition_penalty=0.7),
             dict(frequency_penalty=-0.5),
             dict(logit_bias={432: 3.0, 5: 2.0}),
             dict(min_tokens=12, stop_token_ids=[432, 367, 362]),
             dict(prompt_logprobs=2),
             dict(max_tokens=None)]
    batch, params = [], []
    for kind in kinds:
        for p in prompts[:4]:
            batch.append(p)
            params.append(SamplingParams(**{"temperature": 0.0, "max_tokens": 24,
                                            "ignore_eos": True, **kind}))
    want = generate(plain, batch, params)
    counters = SpecCounters(spec)
    got = generate(spec, batch, params)
    counters.assert_exercised()
    spec_decode_utils.assert_same_outputs(got, want)
    # min_tokens held the stop ids back, then one of them stopped some request.
    assert any(o.outputs[0].finish_reason == "stop" for o in got)
    assert all(len(o.outputs[0].token_ids) >= 12 for o in got[16:20])
    assert all(len(o.outputs[0].token_ids) + len(o.prompt_token_ids) == 128
               for o in got[24:28])
    assert_pool_free(spec)


def test_sampled_logprobs_are_the_models(spec, plain, prompts):
    """Random sampling with drafts, in a batch with greedy rows: each emitted token's logprob
    (and top-2) is the model's at that position, i.e. the spec-off engine's prompt logprobs of
    the prompt followed by the output."""
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(seed=3, logprobs=2, **RANDOM),
              SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=2,
                             seed=4),
              SamplingParams(temperature=0.5, top_p=0.9, max_tokens=24, ignore_eos=True,
                             logprobs=2, seed=5, repetition_penalty=1.2),
              SamplingParams(temperature=0.3, min_p=0.1, max_tokens=24, ignore_eos=True,
                             logprobs=2, seed=6)]
    counters = SpecCounters(spec)
    got = generate(spec, prompts, params)
    counters.assert_exercised()
    check = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    for prompt, o in zip(prompts, got, strict=True):
        c = o.outputs[0]
        ref = generate(plain, [prompt + list(c.token_ids)], check)[0].prompt_logprobs
        ref = ref[len(prompt):]
        for j, (d, e) in enumerate(zip(c.logprobs, ref, strict=True)):
            assert list(d) == list(e), j
            for t in e:
                assert (d[t].rank, d[t].logprob) == (e[t].rank, pytest.approx(e[t].logprob,
                                                                               abs=1e-4)), j
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(ref, c.token_ids, strict=True)), abs=1e-3)
    assert_pool_free(spec)


def test_greedy_logprobs_close_to_spec_off(spec, plain, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = generate(plain, prompts, params)
    counters = SpecCounters(spec)
    got = generate(spec, prompts, params)
    counters.assert_exercised()

    def pairs(outs):
        return [(list(o.outputs[0].token_ids),
                 [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    check_logprobs_close(pairs(got), pairs(want), name_a="spec", name_b="plain")
    spec_decode_utils.assert_same_outputs(got, want)
    assert_pool_free(spec)


def test_seeded_sampling_is_batch_independent(spec, prompts):
    seeded = SamplingParams(seed=77, **RANDOM)
    counters = SpecCounters(spec)
    alone = token_ids(generate(spec, [prompts[2]], seeded))
    others = [SamplingParams(seed=5 + i, **RANDOM) for i in range(3)]
    batched = generate(spec, [prompts[0], prompts[2], prompts[1], prompts[4]],
                       [others[0], seeded, others[1], others[2]])
    assert token_ids(batched)[1] == alone[0]
    again = token_ids(generate(spec, [prompts[2]], seeded))
    assert again == alone
    counters.assert_exercised()
    assert_pool_free(spec)


def test_seeded_sampling_is_batch_independent_beyond_a_spec_bucket(spec_tight, prompts):
    """Five running requests are more than the largest spec-decode bucket (4 sequences)
    holds: the seeded request gets no drafts while they all run, and drafts alone; its
    tokens are the same (one draw per emitted token, drafts or not)."""
    seeded = SamplingParams(seed=77, **RANDOM)
    counters = SpecCounters(spec_tight)
    alone = token_ids(generate(spec_tight, [prompts[2][:12]], seeded))
    others = [SamplingParams(seed=5 + i, **RANDOM) for i in range(4)]
    batch = [prompts[0][:8], prompts[2][:12], prompts[1][:8], prompts[3][:8], prompts[4]]
    batched = generate(spec_tight, batch, [others[0], seeded, *others[1:]])
    assert counters.delta()["num_spec_draft_tokens"] > 0
    assert_pool_free(spec_tight)
    assert token_ids(batched)[1] == alone[0]


def test_seeded_sampling_equals_spec_off(spec, plain, prompts):
    """N-gram drafts are point masses: a seeded request draws each token as it would without
    drafts, so its tokens are the spec-off engine's, in a batch with other kinds of rows."""
    params = [SamplingParams(seed=21 + i, **kw) for i, kw in enumerate([
        RANDOM, dict(RANDOM, temperature=1.0, top_k=-1), dict(RANDOM, top_p=0.8),
        dict(RANDOM, min_p=0.05, repetition_penalty=1.2), dict(RANDOM, logprobs=2)])]
    spec_decode_utils.check_equals_spec_off(spec, plain, prompts, params).assert_exercised()


def test_seeded_n2_and_unseeded_sampling_run(spec, prompts):
    """n = 2 with a seed (children draw from their own streams), and unseeded requests: each
    gets its tokens, drafts are accepted in random sampling too."""
    counters = SpecCounters(spec)
    params = SamplingParams(n=2, seed=11, **RANDOM)
    first = generate(spec, [prompts[0], prompts[3]], params)
    second = generate(spec, [prompts[0], prompts[3]], params)
    assert token_ids(first) == token_ids(second)
    assert all(len(c.token_ids) == RANDOM["max_tokens"] for o in first for c in o.outputs)
    free = generate(spec, prompts, SamplingParams(**RANDOM))
    assert all(len(o.outputs[0].token_ids) == RANDOM["max_tokens"] for o in free)
    assert all(0 <= t < VOCAB for ids in token_ids(free) for t in ids)
    counters.assert_exercised()
    assert_pool_free(spec)


def test_aborts_mid_run_leave_every_block_free(spec, prompts, plain_greedy):
    counters = spec_decode_utils.check_aborts_mid_run(spec, prompts, plain_greedy)
    counters.assert_exercised(rejected=False)


def test_multiprocess_mode(model, prompts, plain_greedy):
    llm = make_llm(model, dtype="float32", multiprocess_mode=True, max_num_seqs=4,
                   max_num_batched_tokens=32, speculative_config=ngram(2))
    try:
        counters = spec_decode_utils.check_greedy_without_recompiles(llm, plain_greedy, prompts)
        counters.assert_exercised()
    finally:
        llm.shutdown()


# --- tiny-qwen2: real tokenizer (stop strings, structured outputs) ------------------------------

TEXT_PROMPTS = ["Repeat after me: one two three, one two three, one two three,",
                "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):"]


# Few buckets: the 151,936-token vocabulary makes each one slow to compile.
QWEN_KW = dict(skip_tokenizer_init=False, max_model_len=128, max_num_seqs=2,
               max_num_batched_tokens=32, multiprocess_mode=False)


@pytest.fixture(scope="module")
def qwen_plain():
    return make_llm(tiny_qwen2_path(), **QWEN_KW)


@pytest.fixture(scope="module")
def qwen_spec():
    return make_llm(tiny_qwen2_path(), **QWEN_KW, speculative_config=ngram(4))


def test_stop_strings_cut_as_spec_off(qwen_plain, qwen_spec):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = [o.outputs[0] for o in qwen_plain.generate(TEXT_PROMPTS, base, use_tqdm=False)]
    tokenizer = qwen_plain.get_tokenizer()
    counters = SpecCounters(qwen_spec)
    for prompt, out in zip(TEXT_PROMPTS, full, strict=True):
        for m in (5, 6, 9):
            # The text from its second character to the end of token m: completed by token m
            # at the earliest, which may arrive with accepted drafts after it.
            stop = out.text[1:len(tokenizer.decode(out.token_ids[:m]))]
            for include in (False, True):
                params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                        stop=[stop], include_stop_str_in_output=include,
                                        logprobs=1)
                want_all = qwen_plain.generate(prompt, params, use_tqdm=False)
                got_all = qwen_spec.generate(prompt, params, use_tqdm=False)
                want, got = want_all[0].outputs[0], got_all[0].outputs[0]
                assert (want.finish_reason, want.stop_reason) == ("stop", stop)
                assert m <= len(want.token_ids) < len(out.token_ids)
                assert want.text == out.text[:out.text.index(stop) + include * len(stop)]
                assert got.text == want.text
                # Tokens past the stop string are dropped with their logprobs.
                assert len(got.logprobs) == len(got.token_ids)
                spec_decode_utils.assert_same_outputs(got_all, want_all)
    counters.assert_exercised(rejected=False)
    assert_pool_free(qwen_spec)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["aa", "aa aa", "b"]},
                                  "maxItems": 4}}}
REGEX = r"(ab){2,8}c"


@pytest.mark.parametrize("kind", ["json", "regex"])
def test_structured_outputs_equal_spec_off(qwen_plain, qwen_spec, kind):
    if kind == "json":
        so = dict(json=PERSON, disable_any_whitespace=True)
    else:
        so = dict(regex=REGEX)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    prompts = [p + " ab ab ab ab" for p in TEXT_PROMPTS]
    want = [o.outputs[0] for o in qwen_plain.generate(prompts, params, use_tqdm=False)]
    counters = SpecCounters(qwen_spec)
    got = [o.outputs[0] for o in qwen_spec.generate(prompts, params, use_tqdm=False)]
    for g, w in zip(got, want, strict=True):
        assert (g.text, list(g.token_ids), g.finish_reason) == \
            (w.text, list(w.token_ids), w.finish_reason)
        assert g.finish_reason == "stop", g.text
        if kind == "json":
            jsonschema.validate(json.loads(g.text), PERSON)
        else:
            assert re.fullmatch(REGEX, g.text), g.text
    counters.assert_exercised()
    assert_pool_free(qwen_spec)


# --- configuration errors ---------------------------------------------------------------------

@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 3}, r"speculative_config\.method"),
    ({"num_speculative_tokens": 3}, r"speculative_config\.method"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2},
     r"speculative_config has unknown key\(s\) \['lookahead'\]"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     r"speculative_config\.num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5},
     r"speculative_config\.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True},
     r"speculative_config\.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0},
     r"speculative_config\.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, r"speculative_config: prompt_lookup_min \(4\) exceeds "
                               r"prompt_lookup_max \(2\)"),
    ({"method": "draft_model", "num_speculative_tokens": 3},
     r"speculative_config: method 'draft_model' needs 'model'"),
    ('{"method": "ngram", "num_speculative_tokens": 3', r"speculative_config is not valid JSON"),
    ("[1, 2]", r"speculative_config must be a dict"),
    ({"method": "ngram", "num_speculative_tokens": 64},
     r"speculative_config\.num_speculative_tokens \(64\) must be below "
     r"max_num_batched_tokens \(64\)"),
])
def test_bad_speculative_config_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="tiny-qwen2", max_num_batched_tokens=64, speculative_config=value)


def test_async_scheduling_is_off_with_speculation(caplog):
    with caplog.at_level("WARNING"):
        assert resolve_async_scheduling(True, speculative=True) is False
    assert "async_scheduling is off with speculative decoding" in caplog.text
    assert resolve_async_scheduling(None, speculative=True) is False
    assert resolve_async_scheduling(None, speculative=False) is True


def test_speculative_config_from_json_text():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    assert SpeculativeConfig.from_dict(text) == SpeculativeConfig("ngram", 4, 2, 3)
