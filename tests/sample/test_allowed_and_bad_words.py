"""allowed_token_ids and bad_words in the host sampler and the rejection sampler, against a
numpy reference written from vLLM V1's rules: allowed ids and the structured-output mask first
(every other token -inf), then each bad-word sequence whose all-but-last tokens end the output
bans its last token, then logit_bias, min_tokens and the penalties. Plus the three new fields'
validation in SamplingParams and in the Processor (no engine needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from jaxllm.engine.processor import Processor
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.rejection_sampler import verify
from jaxllm.sample.sampler import (
    SamplingRow,
    banned_tokens,
    needs_processing,
    process_logits,
    sample,
)
from jaxllm.sample.token_mask import TokenMask
from jaxllm.sampling_params import SamplingParams


def reference_processed(raw: np.ndarray, row: SamplingRow) -> np.ndarray:
    """The processed row, one rule at a time, in vLLM V1's order (plain Python loops)."""
    params = row.params
    vocab = raw.shape[0]
    z = raw.astype(np.float64).copy()
    out = list(row.output_token_ids)
    if params.allowed_token_ids:
        allowed = set(params.allowed_token_ids)
        for t in range(vocab):
            if t not in allowed:
                z[t] = -np.inf
    for word in params.bad_words_token_ids or ():
        prefix = list(word[:-1])
        if len(prefix) <= len(out) and (not prefix or out[len(out) - len(prefix):] == prefix):
            z[word[-1]] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        z[t] += b
    if len(out) < params.min_tokens:
        for t in set(params.stop_token_ids or ()) | set(row.eos_token_ids):
            z[t] = -np.inf
    seen = set(row.prompt_token_ids) | set(out)
    for t in seen:
        if params.repetition_penalty != 1.0:
            rep = params.repetition_penalty
            z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
    for t in set(out):
        z[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
    return z


def with_bad_words(ids: list[list[int]], **kw: Any) -> SamplingParams:
    sp = SamplingParams(**kw)
    sp.bad_words_token_ids = ids
    return sp


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["3"]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"allowed_token_ids": [2**31]}, "allowed_token_ids"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["ok", " \n"]}, "bad_words"),
    ({"bad_words": [3]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "3"}, "truncate_prompt_tokens"),
    ({"_bad_words_token_ids": [[]]}, "bad_words"),
    ({"_bad_words_token_ids": [[1, -1]]}, "bad_words"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} .*, got "):
        SamplingParams(**kwargs)


def test_valid_values_are_normalised_and_travel_in_clones():
    sp = SamplingParams(allowed_token_ids=(np.int64(3), 5), bad_words=("a b",),
                        truncate_prompt_tokens=-1)
    assert sp.allowed_token_ids == [3, 5] and type(sp.allowed_token_ids[0]) is int
    assert sp.bad_words == ["a b"] and sp.truncate_prompt_tokens == -1
    sp.bad_words_token_ids = [(1, 2), [3]]
    assert sp.bad_words_token_ids == [[1, 2], [3]]
    twin = sp.clone()
    assert twin.bad_words_token_ids == [[1, 2], [3]]
    assert twin.bad_words_token_ids is not sp.bad_words_token_ids


def test_the_token_ids_cross_the_engine_core_wire():
    from jaxllm.engine.serial_utils import MsgpackDecoder, MsgpackEncoder

    sp = with_bad_words([[7, 8], [9]], allowed_token_ids=[1, 2], bad_words=["x"],
                        truncate_prompt_tokens=4)
    back = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(sp))
    assert back.bad_words_token_ids == [[7, 8], [9]]
    assert (back.allowed_token_ids, back.bad_words, back.truncate_prompt_tokens) == \
        ([1, 2], ["x"], 4)


class FakeTokenizer:
    """Words are tokens: each space-separated word -> 10 + its length; a word after a space
    gets 100 added (a byte-level BPE merges the space into the word's first token)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        ids = []
        for i, word in enumerate(text.split(" ")):
            if word:
                ids.append(10 + len(word) + (100 if i > 0 else 0))
        return ids


def make_processor(tokenizer: Any = None, vocab: int = 1000, max_model_len: int = 64) -> Processor:
    info = SimpleNamespace(model_config=SimpleNamespace(vocab_size=vocab, hidden_size=64),
                           max_model_len=max_model_len,
                           config=SimpleNamespace(block_size=16, runner="generate",
                                                  reasoning_parser=None,
                                                  max_num_batched_tokens=64,
                                                  enable_lora=False, max_lora_rank=16,
                                                  max_cpu_loras=1),
                           num_usable_blocks=100, kv_group_windows=(None,))
    return Processor(tokenizer, cast(Any, info), frozenset({0}), max_n=4)


def test_processor_tokenizes_bad_words_as_vllm():
    proc = make_processor(FakeTokenizer())
    # "ab" alone and " ab" (another first token, same length): both; "  ab cd" loses its
    # leading spaces; with FakeTokenizer every spaced spelling starts with another token.
    assert proc.bad_words_token_ids(["ab", "  ab cd"]) == [[12], [112], [12, 112], [112, 112]]
    req = proc.process_inputs("r", {"prompt_token_ids": [1, 2, 3]},
                              SamplingParams(bad_words=["ab"], n=2))
    children = req.child_requests
    assert [c.sampling_params.bad_words_token_ids for c in children] == [[[12], [112]]] * 2
    # A word whose spaced spelling has more tokens than the plain one keeps only the plain one,
    # and one whose spaced spelling starts with the same token too.

    class Merging(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [7, 6] if text.startswith(" ") else [5]

    assert make_processor(Merging()).bad_words_token_ids(["w"]) == [[5]]

    class SameStart(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [5, 9] if text.startswith(" ") else [5, 8]

    assert make_processor(SameStart()).bad_words_token_ids(["w"]) == [[5, 8]]


def test_each_bad_word_is_tokenized_once():
    calls = []

    class Counting(FakeTokenizer):
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            calls.append(text)
            return super().encode(text, add_special_tokens)

    proc = make_processor(Counting())
    first = proc.bad_words_token_ids(["ab", "  ab cd"])
    n = len(calls)
    assert proc.bad_words_token_ids(["  ab cd", "ab"]) == first[2:] + first[:2]
    assert len(calls) == n
    first[0].append(99)  # the caller's lists are its own
    assert proc.bad_words_token_ids(["ab"]) == [[12], [112]] and len(calls) == n
    assert make_processor(FakeTokenizer()).bad_words_token_ids(["ab", "  ab cd"]) == \
        proc.bad_words_token_ids(["ab", "  ab cd"])


def test_processor_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words needs a tokenizer"):
        make_processor().process_inputs("r", {"prompt_token_ids": [1]},
                                        SamplingParams(bad_words=["x"]))
    with pytest.raises(ValueError, match=r"SamplingParams\.allowed_token_ids .*\[1000\]"):
        make_processor().process_inputs("r", {"prompt_token_ids": [1]},
                                        SamplingParams(allowed_token_ids=[3, 1000]))
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words tokenize to ids \[1012\]"):
        make_processor(FakeTokenizer(), vocab=1000).process_inputs(
            "r", {"prompt_token_ids": [1]}, SamplingParams(bad_words=["a" * 902]))
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens must be at "
                                         r"most max_model_len \(64\)"):
        make_processor().process_inputs("r", {"prompt_token_ids": [1]},
                                        SamplingParams(truncate_prompt_tokens=65))


def test_processor_truncates_before_the_length_check():
    proc = make_processor(max_model_len=64)
    prompt = {"prompt_token_ids": list(range(1, 101))}
    with pytest.raises(ValueError, match="the prompt has 100 tokens"):
        proc.process_inputs("r", prompt, SamplingParams())
    got = proc.process_inputs("r", prompt, SamplingParams(truncate_prompt_tokens=10))
    assert got.prompt_token_ids == list(range(91, 101))
    assert got.child_requests[0].prompt_token_ids == list(range(91, 101))
    assert got.child_requests[0].max_tokens == 16
    whole = proc.process_inputs("r", prompt, SamplingParams(truncate_prompt_tokens=-1,
                                                            max_tokens=None))
    assert whole.prompt_token_ids == list(range(38, 101))  # max_model_len - 1 tokens
    assert whole.child_requests[0].max_tokens == 1
    short = proc.process_inputs("r", {"prompt_token_ids": [4, 5]},
                                SamplingParams(truncate_prompt_tokens=10))
    assert short.prompt_token_ids == [4, 5]


# --- the host sampler ----------------------------------------------------------------------------


def test_banned_tokens_follow_the_prefix_rule():
    words = [[5, 6, 7], [3], [6, 9], [1, 2, 3, 4]]
    assert banned_tokens(words, []) == [3]  # a one-token word is always banned
    assert banned_tokens(words, [8, 5, 6]) == [7, 3, 9]
    assert banned_tokens(words, [5, 6, 8]) == [3]
    assert banned_tokens(words, [6]) == [3, 9]
    assert banned_tokens(words, [5]) == [3]  # a prefix must match whole
    assert banned_tokens(words, [1, 2, 3]) == [3, 4]
    assert banned_tokens(words, [2, 3]) == [3]  # shorter than the prefix
    assert banned_tokens(None, [1, 2]) == []


def test_random_rows_match_the_reference(rng):
    vocab = 200
    rows, matched, unmatched = [], 0, 0
    for i in range(40):
        output = rng.integers(0, 40, int(rng.integers(0, 8))).tolist()
        words = []
        for _ in range(int(rng.integers(0, 4))):
            n = int(rng.integers(1, 4))
            if output and n > 1 and rng.random() < 0.5:  # plant a prefix that ends the output
                prefix = output[-(n - 1):]
                words.append(prefix + [int(rng.integers(0, vocab))])
            else:
                words.append(rng.integers(0, 40, n).tolist())
        kw: dict[str, Any] = dict(temperature=[0.0, 0.9][i % 2])
        if i % 3 == 0:
            kw["allowed_token_ids"] = rng.choice(vocab, int(rng.integers(1, 30)),
                                                 replace=False).tolist()
        if i % 4 == 1:
            bias = {int(t): float(rng.normal(0, 5)) for t in rng.integers(0, vocab, 5)}
            kw.update(logit_bias=bias, repetition_penalty=1.4, frequency_penalty=0.5,
                      presence_penalty=-0.3)
        if i % 5 == 2:
            kw.update(min_tokens=10, stop_token_ids=[int(rng.integers(0, vocab))])
        sp = with_bad_words(words, **kw) if words else SamplingParams(**kw)
        row = SamplingRow(sp, np.random.default_rng(i), rng.integers(0, vocab, 5).tolist(), output,
                          frozenset({vocab - 1}))
        for w in words:
            ends = len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]
            if len(w) > 1 and ends:
                matched += 1
            elif len(w) > 1:
                unmatched += 1
        rows.append(row)
    assert matched >= 5 and unmatched >= 5  # both branches of the prefix rule are exercised
    logits = rng.normal(0, 3, (len(rows), vocab)).astype(np.float32)
    got = process_logits(logits, rows)
    want = np.stack([reference_processed(logits[i], r) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    np.testing.assert_array_equal(sample(logits, rows).token_ids[greedy], want[greedy].argmax(-1))
    # Random rows draw only tokens the reference leaves finite.
    for _ in range(5):
        toks = sample(logits, rows).token_ids
        assert all(np.isfinite(want[i, t]) for i, t in enumerate(toks.tolist()))


def test_masks_hold_against_bias_and_penalties(rng):
    vocab = 50
    raw = rng.normal(0, 1, vocab).astype(np.float32)
    sp = with_bad_words([[4, 9], [11]], temperature=0.0, allowed_token_ids=[2, 9, 11, 20],
                        logit_bias={9: 100.0, 11: 100.0, 30: 100.0, 2: 50.0},
                        repetition_penalty=0.5, frequency_penalty=-2.0)
    row = SamplingRow(sp, None, [20], [4, 4])
    z = process_logits(raw[None], [row])[0]
    # 30: not allowed; 9: banned after 4; 11: always banned: biases cannot bring them back.
    assert set(np.flatnonzero(np.isfinite(z)).tolist()) == {2, 20}
    assert z[2] == pytest.approx(raw[2] + 50.0)
    # 20 was seen in the prompt: the repetition penalty applies to the allowed token.
    assert z[20] == pytest.approx(raw[20] / 0.5 if raw[20] > 0 else raw[20] * 0.5)
    assert sample(raw[None], [row]).token_ids[0] == 2
    # Many draws of a random row stay inside what is left.
    sp_rand = with_bad_words([[4, 9], [11]], temperature=1.0, allowed_token_ids=[2, 9, 11, 20])
    draws = {int(sample(raw[None], [SamplingRow(sp_rand, np.random.default_rng(s), [], [4])]
                        ).token_ids[0]) for s in range(60)}
    assert draws == {2, 20}


def test_rows_without_a_matching_prefix_are_not_processed():
    sp = with_bad_words([[5, 6, 7]], temperature=0.0)
    assert not needs_processing(SamplingRow(sp, None, [5, 6], [1]))  # the prompt does not count
    assert needs_processing(SamplingRow(sp, None, [], [5, 6]))
    assert needs_processing(SamplingRow(SamplingParams(allowed_token_ids=[1]), None))
    raw = np.arange(10, dtype=np.float32)[None]
    np.testing.assert_array_equal(process_logits(raw, [SamplingRow(sp, None, [], [1])]), raw)
    meta = SamplingMetadata.from_params([sp, SamplingParams(allowed_token_ids=[1]),
                                         SamplingParams()])
    assert meta.maybe_processed.tolist() == [True, True, False]


# --- the rejection sampler ------------------------------------------------------------------------


def sequential(logits: np.ndarray, row: SamplingRow, drafts: list[int]) -> list[int]:
    """What decoding without drafts emits from the same rows: position j sampled with the
    drafts before it as output, until a sampled token differs from its draft."""
    out = []
    for j in range(len(drafts) + 1):
        r = SamplingRow(row.params, row.generator, row.prompt_token_ids,
                        list(row.output_token_ids) + drafts[:j], row.eos_token_ids)
        tok = int(sample(logits[j:j + 1], [r]).token_ids[0])
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_sees_the_draft_prefix(rng, temperature):
    vocab = 64
    checked_ban = 0
    for trial in range(30):
        drafts = rng.integers(0, vocab, 4).tolist()
        logits = rng.normal(0, 1, (5, vocab)).astype(np.float32)
        # The drafts are the rows' favourites (so they are accepted unless banned), and the
        # word [d0, d1, d2] bans the third draft at position 2 only because of drafts 0 and 1.
        for j, d in enumerate(drafts):
            logits[j, d] += 8.0
        words = [[drafts[0], drafts[1], drafts[2]], [int(rng.integers(0, vocab))]]
        kw: dict[str, Any] = dict(temperature=temperature, seed=trial)
        if trial % 2:
            kw["allowed_token_ids"] = sorted(set(drafts) | set(
                rng.integers(0, vocab, 20).tolist()))
        sp = with_bad_words(words, **kw)
        output = rng.integers(0, vocab, 3).tolist()

        got = verify(logits, drafts,
                     SamplingRow(sp, np.random.default_rng(trial), [1, 2], output))
        want = sequential(logits, SamplingRow(sp, np.random.default_rng(trial), [1, 2], output),
                          drafts)
        assert got.token_ids == want
        assert got.num_accepted == len(want) - 1
        if len(want) >= 3 and words[1][0] != drafts[2] and drafts[2] != drafts[0]:
            assert want[2] != drafts[2]  # banned inside the drafts
            checked_ban += 1
    assert checked_ban >= 5


# --- rows with no token left ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_with_no_token_left_is_an_error_not_a_token(rng, temperature):
    vocab = 32
    logits = rng.normal(0, 1, (3, vocab)).astype(np.float32)
    grammar = TokenMask.from_allowed(np.arange(vocab) >= 16, vocab)
    rows = [
        # allowed_token_ids outside what the grammar allows
        SamplingRow(SamplingParams(temperature=temperature, allowed_token_ids=[3, 4]),
                    np.random.default_rng(0), mask=grammar),
        SamplingRow(SamplingParams(temperature=temperature), np.random.default_rng(1)),
        # min_tokens masks the only allowed token, an EOS
        SamplingRow(SamplingParams(temperature=temperature, allowed_token_ids=[7],
                                   min_tokens=2), np.random.default_rng(2),
                    eos_token_ids=frozenset({7})),
    ]
    out = sample(logits, rows)
    assert sorted(out.errors) == [0, 2]
    assert "structured-output" in out.errors[0] and "allowed_token_ids" in out.errors[0]
    assert "min_tokens" in out.errors[2] and "allowed_token_ids" in out.errors[2]
    want = sample(logits[1:2], [SamplingRow(SamplingParams(temperature=temperature),
                                            np.random.default_rng(1))]).token_ids[0]
    assert out.token_ids[1] == want


def test_verify_stops_where_the_drafts_lead_to_no_token():
    vocab = 16
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 5] = 4.0  # draft 5 is every row's favourite
    # After a 5 both allowed tokens are banned: position 1 has nothing left.
    sp = with_bad_words([[5, 5], [5, 9]], temperature=0.0, allowed_token_ids=[5, 9])
    got = verify(logits, [5, 5], SamplingRow(sp, None, [1], [2]))
    assert got.error is not None and "bad_words" in got.error
    # The draft accepted before that position is kept: the request ends after it.
    assert got.token_ids == [5] and got.num_accepted == 1
    # Without the drafts, position 0 samples the 5 and the next step finds nothing left.
    first = sample(logits[:1], [SamplingRow(sp, None, [1], [2])])
    assert first.token_ids.tolist() == [5] and not first.errors
    after = sample(logits[1:2], [SamplingRow(sp, None, [1], [2, 5])])
    assert list(after.errors) == [0]
