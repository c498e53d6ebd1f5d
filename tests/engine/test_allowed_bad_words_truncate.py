"""allowed_token_ids, bad_words and truncate_prompt_tokens end to end on `tiny-qwen2` (random
weights, the real Qwen2.5 tokenizer), with and without n-gram speculation.

Oracles: greedy with allowed_token_ids equals greedy with a +100 logit_bias on the same tokens
(the argmax over the allowed ones, through the separately tested bias path); bad_words: the
plain greedy output up to where a bad word would complete, then anything else, and no bad word
anywhere; truncation: the truncated prompt given directly; speculation: the same greedy tokens
as without it, with drafts verified on the way (the model repeats itself, so prompt lookup
proposes the very continuations the bad words ban)."""

from __future__ import annotations

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
from tests.engine.spec_decode_utils import SpecCounters, ngram
from tests.utils import assert_pool_free, kv_budget_kwargs

PROMPTS = ["Repeat after me: one two three, one two three, one two three,",
           "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):",
           "The capital of France is"]
GREEDY = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
# Few buckets: with the real vocabulary each one is slow to compile.
KW = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
          multiprocess_mode=False, show_progress=False)


def make(**kw) -> LLM:
    return LLM(model=str(tiny_qwen2_path()), **{**KW, **kv_budget_kwargs(), **kw})


@pytest.fixture(scope="module")
def plain():
    return make()


@pytest.fixture(scope="module")
def spec():
    return make(speculative_config=ngram(4), topk_sampling=True)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def occurs(seq: list[int], word: list[int]) -> int | None:
    """The index of seq where `word` is first completed, or None."""
    n = len(word)
    for m in range(n - 1, len(seq)):
        if seq[m - n + 1:m + 1] == word:
            return m
    return None


def bad_word_cases(llm: LLM, outputs: list[list[int]]) -> list[tuple[int, str, int]]:
    """Per prompt, a word decoded from its greedy output whose token sequence (as the
    processor tokenizes bad words) occurs in that output: (prompt index, word, where it is
    first completed); one- and two-token words."""
    tok = llm.get_tokenizer()
    processor = llm.llm_engine.processor
    cases = []
    for i, out in enumerate(outputs):
        for k in (1, 2):
            for start in range(len(out) - k):
                word = tok.decode(out[start:start + k])
                if not word.strip():
                    continue
                ids = processor.bad_words_token_ids([word]) or []
                hits = [m for w in ids if (m := occurs(out, w)) is not None]
                if hits:
                    cases.append((i, word, min(hits)))
                    break
    return cases


def test_allowed_token_ids_take_the_argmax_over_them(plain):
    base = tokens(plain, PROMPTS, SamplingParams(**GREEDY))
    # The plain greedy tokens are left out: the allowed ones must win on their own logits.
    allowed = sorted(set(range(1000, 1400, 7)) - {t for out in base for t in out})
    got = tokens(plain, PROMPTS, SamplingParams(**GREEDY, allowed_token_ids=allowed))
    want = tokens(plain, PROMPTS, SamplingParams(**GREEDY,
                                                 logit_bias={t: 100.0 for t in allowed}))
    assert got == want
    assert all(t in allowed for out in got for t in out)
    assert got != base
    # Sampled rows draw only allowed tokens too.
    sampled = tokens(plain, PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                                    ignore_eos=True, allowed_token_ids=allowed))
    assert all(t in allowed for out in sampled for t in out)
    assert_pool_free(plain)


def test_bad_words_never_complete(plain):
    base = tokens(plain, PROMPTS, SamplingParams(**GREEDY))
    cases = bad_word_cases(plain, base)
    # Words of one token (banned at every step) and of two (banned after the first).
    assert {len(plain.get_tokenizer().encode(w.lstrip())) for _, w, _ in cases} == {1, 2}
    processor = plain.llm_engine.processor
    for i, word, m in cases:
        out = tokens(plain, [PROMPTS[i]], SamplingParams(**GREEDY, bad_words=[word]))[0]
        assert out[:m] == base[i][:m], word
        assert out[m] != base[i][m], word
        for w in processor.bad_words_token_ids([word]) or []:
            assert occurs(out, w) is None, (word, w, out)
    assert_pool_free(plain)


def test_speculation_gives_the_same_tokens(plain, spec):
    base = tokens(plain, PROMPTS, SamplingParams(**GREEDY))
    words = [w for _, w, _ in bad_word_cases(plain, base)]
    tok = plain.get_tokenizer()
    longer = [w for w in words if len(tok.encode(w.lstrip())) > 1]
    assert longer
    # A one-token word the model repeats, six times over: banned only after five of it, so a
    # step may start clean (its first position needs no processing) while the drafts, the
    # repetition that prompt lookup proposes, complete the word.
    single = next(w for w in words if len(tok.encode(w.lstrip())) == 1)
    six = single.lstrip() * 6
    assert [len(w) for w in plain.llm_engine.processor.bad_words_token_ids([six]) or []][0] == 6
    # The two-token words leave the repeated token allowed after anything else: the drafts
    # that prompt lookup proposes (the repetition) hold the banned pair.
    params = [SamplingParams(**GREEDY, bad_words=words),
              SamplingParams(**GREEDY, bad_words=longer),
              SamplingParams(**GREEDY, bad_words=[six]),
              SamplingParams(**GREEDY, allowed_token_ids=sorted({t for o in base for t in o}
                                                                | set(range(200, 260))))]
    batch = [p for p in PROMPTS for _ in params]
    all_params = params * len(PROMPTS)
    want = tokens(plain, batch, all_params)
    counters = SpecCounters(spec)
    got = tokens(spec, batch, all_params)
    assert got == want
    # One at a time too: the steps, so where drafts start and stop, differ from the batch's.
    for k, (prompt, p) in enumerate(zip(batch, all_params, strict=True)):
        assert tokens(spec, [prompt], p) == [want[k]], (prompt, p)
    counters.assert_exercised()
    assert_pool_free(spec)


def test_truncate_prompt_tokens_equals_the_truncated_prompt(plain):
    ids = plain.get_tokenizer().encode(PROMPTS[1])
    assert len(ids) > 12
    params = SamplingParams(**GREEDY, truncate_prompt_tokens=12)
    got = plain.generate(PROMPTS[1], params, use_tqdm=False)[0]
    want = plain.generate({"prompt_token_ids": ids[-12:]}, SamplingParams(**GREEDY),
                          use_tqdm=False)[0]
    assert list(got.prompt_token_ids) == ids[-12:]
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    # The prompt's text is what was kept (an echo matches its tokens).
    assert got.prompt == plain.get_tokenizer().decode(ids[-12:]) != PROMPTS[1]
    # A prompt longer than the model takes fits once truncated; -1 keeps max_model_len - 1.
    long = (ids * 20)[:300]
    with pytest.raises(ValueError, match="max_model_len"):
        plain.generate({"prompt_token_ids": long}, SamplingParams(**GREEDY), use_tqdm=False)
    whole = SamplingParams(temperature=0.0, max_tokens=None, truncate_prompt_tokens=-1)
    out = plain.generate({"prompt_token_ids": long}, whole, use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == long[-127:] and len(out.outputs[0].token_ids) == 1
    chat = plain.chat([{"role": "user", "content": "hello " * 200}],
                      SamplingParams(**GREEDY, truncate_prompt_tokens=20), use_tqdm=False)[0]
    assert len(chat.prompt_token_ids) == 20
    assert chat.prompt == plain.get_tokenizer().decode(chat.prompt_token_ids)
    assert_pool_free(plain)


def test_refusals(plain):
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids has token ids "
                                         r"\[151936\]"):
        plain.generate("x", SamplingParams(allowed_token_ids=[5, 151936]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens must be at "
                                         r"most max_model_len \(128\)"):
        plain.generate("x", SamplingParams(truncate_prompt_tokens=129), use_tqdm=False)
    tokenizer = plain.get_tokenizer()
    word = next(w for w in ("hello", "the", "a") if len(tokenizer.encode(w)) == 1)
    ids = sorted({tokenizer.encode(w)[0] for w in (word, " " + word)
                  if len(tokenizer.encode(w)) == 1})
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids leaves no token"):
        plain.generate("x", SamplingParams(allowed_token_ids=ids, bad_words=[word]),
                       use_tqdm=False)
    assert_pool_free(plain)


@pytest.mark.parametrize("which", ["plain", "spec"])
def test_no_token_left_finishes_that_request_with_an_error(request, which):
    llm = request.getfixturevalue(which)
    eos = llm.get_tokenizer().eos_token_id
    # The only allowed token is the EOS, which min_tokens masks: nothing can be sampled.
    stuck = SamplingParams(**GREEDY, allowed_token_ids=[eos], min_tokens=4)
    alone = llm.generate(PROMPTS[1:], SamplingParams(**GREEDY), use_tqdm=False)
    outs = llm.generate(PROMPTS, [stuck] + [SamplingParams(**GREEDY)] * 2, use_tqdm=False)
    first = outs[0].outputs[0]
    assert first.finish_reason == "error" and first.token_ids == []
    assert "min_tokens" in str(first.stop_reason) and "allowed_token_ids" in str(
        first.stop_reason)
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in alone]
    assert_pool_free(llm)


def test_drafts_accepted_before_a_position_with_no_token_are_kept(plain, spec):
    """Allowed only the token the model repeats, and banned from repeating it n times: the
    request ends with an error after n - 1 of them. With speculation, drafts accepted before
    that position are emitted as the tokens they are, not dropped with the error."""
    token = tokens(plain, PROMPTS[1:2], SamplingParams(**GREEDY))[0][0]
    word = plain.get_tokenizer().decode([token])
    lengths = (8, 10, 13)
    params = [SamplingParams(**GREEDY, allowed_token_ids=[token], bad_words=[word * n])
              for n in lengths]
    assert [plain.llm_engine.processor.bad_words_token_ids([word * n]) for n in lengths] == \
        [[[token] * n] for n in lengths]
    counters = SpecCounters(spec)
    for llm in (plain, spec):
        outs = [llm.generate(PROMPTS[1:2], p, use_tqdm=False)[0].outputs[0] for p in params]
        assert [list(o.token_ids) for o in outs] == [[token] * (n - 1) for n in lengths]
        assert all(o.finish_reason == "error" and "bad_words" in str(o.stop_reason)
                   for o in outs)
    assert counters.delta()["num_spec_accepted_tokens"] > 0
    assert_pool_free(plain)
    assert_pool_free(spec)
