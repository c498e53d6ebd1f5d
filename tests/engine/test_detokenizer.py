"""IncrementalDetokenizer against the real Qwen2.5 tokenizer (byte-level BPE, 151936 ids)."""

from __future__ import annotations

import random
import time

import pytest

from jaxllm.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
IM_END = 151645

TEXTS = {
    "cjk": "我爱北京天安门。龘靐齉齾，𠀀𠀁𪚥！日本語のテキスト、ひらがな。한국어 텍스트입니다.",
    "emoji": "Family 👨‍👩‍👧 and 👩🏽‍💻 coder, flags 🇯🇵🇺🇸🏳️‍🌈, ❤️‍🔥 😀😃🙏🏿 done",
    "mixed": "Hello мир, γειά σου, مرحبا بالعالم, नमस्ते दुनिया, สวัสดีชาวโลก, שלום, ĉ ŝ ǅ ﬁ Ω≈ç√ ∑",
    "code": ("def f(x):\n\tif x:\n        return  x * 2   \n\n\n"
             "    # 注释 ✓ \U0001F600\n\treturn None\r\n  "),
}
CHUNKINGS = ["one", "two", "three", "seven", "random"]


@pytest.fixture(scope="module")
def tok():
    from jaxllm.model_executor.model_loader.default_model import default_model_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.encode("<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n")


def chunks(ids, how, seed=0):
    if how == "random":
        rng = random.Random(seed)
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 6)
            out.append(ids[i:i + n])
            i += n
        return out
    n = {"one": 1, "two": 2, "three": 3, "seven": 7}[how]
    return [ids[i:i + n] for i in range(0, len(ids), n)]


def stream(tok, prompt, ids, how="one", *, terminate=False, **kw):
    """Feeds ids in chunks; returns (detokenizer, deltas while running, final delta, stop)."""
    d = IncrementalDetokenizer(tok, prompt, **kw)
    deltas, stop = [], None
    parts = chunks(ids, how)
    for k, part in enumerate(parts):
        stop = d.update(part, terminate and k == len(parts) - 1)
        if stop is not None:
            break
        deltas.append(d.get_next_output_text(finished=False, delta=True))
    final = d.get_next_output_text(finished=True, delta=True)
    return d, deltas, final, stop


def streamed_prefixes(deltas):
    acc, out = "", []
    for x in deltas:
        acc += x
        out.append(acc)
    return out


# ------------------------------------------------------------------ plain decoding


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_texts_really_split_characters(tok, name):
    """The test texts exercise the hard case: some tokens alone decode to U+FFFD, or are
    parts of multi-codepoint clusters."""
    ids = tok.encode(TEXTS[name])
    assert tok.decode(ids) == TEXTS[name]
    if name != "code":
        assert any(FFFD in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("with_prompt", [True, False])
def test_stream_equals_decode(tok, chat_prompt, name, how, with_prompt):
    ids = tok.encode(TEXTS[name])
    prompt = chat_prompt if with_prompt else []
    d, deltas, final, stop = stream(tok, prompt, ids, how)
    assert stop is None
    assert all(FFFD not in x for x in deltas + [final])
    assert "".join(deltas) + final == d.output_text == tok.decode(ids) == TEXTS[name]
    assert final == ""  # nothing was held back: every character completed
    assert d.output_token_ids == ids


def test_incremental_text_grows_per_token(tok):
    """Text appears as soon as a character is complete (no needless buffering)."""
    ids = tok.encode(TEXTS["mixed"])
    d = IncrementalDetokenizer(tok, [])
    for k, i in enumerate(ids):
        d.update([i], False)
        full = tok.decode(ids[:k + 1])
        assert d.output_text == full.rstrip(FFFD) or full.endswith(FFFD)
        assert full.startswith(d.output_text)


# ------------------------------------------------------------------ U+FFFD rules


def test_genuine_replacement_char_mid_stream(tok):
    ids = tok.encode("a\ufffdb and more")
    d, deltas, final, _ = stream(tok, [], ids)
    assert "".join(deltas) + final == tok.decode(ids) == "a\ufffdb and more"
    assert "".join(deltas).count(FFFD) == 1


def test_genuine_replacement_char_at_end_is_flushed_on_finish(tok):
    ids = tok.encode("end \ufffd")
    d = IncrementalDetokenizer(tok, [])
    d.update(ids, False)
    assert d.get_next_output_text(finished=False, delta=True) == "end"
    assert d.get_next_output_text(finished=True, delta=True) == " \ufffd"
    assert d.output_text == tok.decode(ids)


def test_incomplete_character_at_end(tok):
    """A request cut (max_tokens) inside a character: held while running, then decoded as the
    tokenizer decodes it (U+FFFD) when the request finishes."""
    ids = tok.encode("ok 龘")[:-1]
    assert tok.decode(ids).endswith(FFFD)
    d = IncrementalDetokenizer(tok, [])
    for i in ids:
        d.update([i], False)
    assert FFFD not in d.output_text
    assert FFFD not in d.get_next_output_text(finished=False, delta=False)
    d.finish()
    assert d.output_text == tok.decode(ids)
    d.finish()  # idempotent
    assert d.output_text == tok.decode(ids)


def test_invalid_byte_run_stays_bounded(tok):
    """Lone UTF-8 lead bytes (degenerate output): each is decided invalid by the next one, so
    text keeps flowing and the decode window stays small."""
    lead = tok.convert_tokens_to_ids("ä")  # byte 0xE4
    ids = [lead] * 300 + tok.encode(" fine")
    d = IncrementalDetokenizer(tok, [])
    for i in ids:
        d.update([i], False)
        assert d.window_size <= 20
    assert d.output_text == tok.decode(ids)


def test_window_stays_small(tok, chat_prompt):
    ids = tok.encode(TEXTS["cjk"] * 20)
    d = IncrementalDetokenizer(tok, chat_prompt)
    longest = 0
    for part in chunks(ids, "random"):
        d.update(part, False)
        longest = max(longest, d.window_size)
    assert longest <= 24
    assert d.output_text == tok.decode(ids)


def test_stop_terminated_flushes_incomplete_character(tok):
    """EOS right after an incomplete character: the request is over, so output_text holds the
    tokenizer's decode at once (no finish() call needed)."""
    ids = tok.encode("ok 龘")[:-1]
    d = IncrementalDetokenizer(tok, [])
    d.update(ids + [IM_END], True)
    assert d.output_text == tok.decode(ids) and d.output_text.endswith(FFFD)


def test_tokenizer_without_rust_backend(tok):
    """Any object with decode(ids, skip_special_tokens=...) works (slow path)."""

    class Plain:
        def decode(self, ids, skip_special_tokens=True):
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(TEXTS["emoji"]) + [IM_END]
    d, deltas, final, _ = stream(Plain(), [], ids, "two", skip_special_tokens=False)
    assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=False)
    assert all(FFFD not in x for x in deltas)


# ------------------------------------------------------------------ prompt context


def test_prompt_context_keeps_leading_space(tok):
    prompt = tok.encode("Hello")
    ids = tok.encode(" world, again")
    d, deltas, final, _ = stream(tok, prompt, ids)
    assert deltas[0] == " world"
    assert d.output_text == " world, again"


def test_character_split_between_prompt_and_output(tok):
    """The prompt ends inside a character (raw token-id prompts can): the character belongs to
    the prompt's text (as in vLLM), no U+FFFD is emitted, and the rest follows."""
    full_ids = tok.encode("Say 龘 ok, then 中文.")
    cut = 2  # 'Say', ' \xe9\xbe' | '\x98', ...
    assert tok.decode(full_ids[:cut]).endswith(FFFD)
    prompt, ids = full_ids[:cut], full_ids[cut:]
    d, deltas, final, _ = stream(tok, prompt, ids)
    full = tok.decode(full_ids)
    assert d.output_text == full[len(tok.decode(prompt)):] == " ok, then 中文."
    assert all(FFFD not in x for x in deltas + [final])


# ------------------------------------------------------------------ special tokens


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_mid_output(tok, skip):
    ids = tok.encode("Answer: yes.") + [IM_END] + tok.encode("\n中文")
    d, deltas, final, _ = stream(tok, [], ids, skip_special_tokens=skip)
    assert d.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in d.output_text) is (not skip)
    assert "".join(deltas) + final == d.output_text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("include", [True, False])
@pytest.mark.parametrize("how", ["one", "seven"])
def test_stop_terminated_drops_eos_text(tok, skip, include, how):
    ids = tok.encode("Hi there 龘") + [IM_END]
    d, deltas, final, stop = stream(tok, [], ids, how, terminate=True, skip_special_tokens=skip,
                                    include_stop_str_in_output=include)
    assert stop is None
    expect = "Hi there 龘" + ("<|im_end|>" if include and not skip else "")
    assert d.output_text == expect
    assert "".join(deltas) + final == expect
    assert d.output_token_ids == ids
    # Later calls change nothing.
    assert d.update([42], False) is None and d.output_text == expect


# ------------------------------------------------------------------ stop strings


def token_boundaries(tok, ids):
    return {len(tok.decode(ids[:k])) for k in range(len(ids) + 1)}


def assert_straddles(tok, ids, text, stop):
    i = text.index(stop)
    inner = token_boundaries(tok, ids) & set(range(i + 1, i + len(stop)))
    assert inner, f"{stop!r} does not straddle a token boundary"


@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, chat_prompt, how, include):
    text = "Hello world, this is a test. And more text after it."
    ids = tok.encode(text)
    stop = "lo wor"
    assert_straddles(tok, ids, text, stop)
    d, deltas, final, got = stream(tok, chat_prompt, ids, how, stop=[stop],
                                   include_stop_str_in_output=include)
    assert got == stop == d.stop_reason
    expect = "Hello wor" if include else "Hel"
    assert d.output_text == expect
    assert "".join(deltas) + final == expect
    for prefix in streamed_prefixes(deltas):
        assert expect.startswith(prefix)
        if not include:
            assert stop not in prefix


@pytest.mark.parametrize("how", CHUNKINGS)
@pytest.mark.parametrize("stop,expect", [
    ("龘。", "我喜欢龘"),      # starts on a character split over two byte tokens
    ("欢龘", "我喜"),          # ends as the split character completes
    ("龘", "我喜欢"),          # the stop is one character split over tokens
    ("。然", "我喜欢龘龘"),
])
def test_stop_string_at_cjk_boundary(tok, how, stop, expect):
    text = "我喜欢龘龘。然后结束了。"
    ids = tok.encode(text)
    if len(stop) > 1:
        assert_straddles(tok, ids, text, stop)
    d, deltas, final, got = stream(tok, [], ids, how, stop=[stop])
    assert got == stop
    assert d.output_text == expect
    assert "".join(deltas) + final == expect
    assert all(FFFD not in x for x in deltas + [final])
    for prefix in streamed_prefixes(deltas):
        assert expect.startswith(prefix) and stop not in prefix


@pytest.mark.parametrize("how", ["one", "three", "random"])
def test_stop_string_cjk_words(tok, how):
    text = "我爱北京天安门。今天天气很好，我们去公园散步吧。"
    ids = tok.encode(text)
    stop = "北京天"
    assert_straddles(tok, ids, text, stop)
    d, deltas, final, got = stream(tok, [], ids, how, stop=["公园", stop])
    assert got == stop and d.output_text == "我爱"


def test_multiple_stops_earliest_wins(tok):
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text)
    for how in ["one", "two", "seven"]:
        d, deltas, final, got = stream(tok, [], ids, how, stop=["delta", "beta", "epsilon"])
        assert got == "beta" and d.output_text == "alpha "
    # Both complete within one step: still the earlier one.
    d = IncrementalDetokenizer(tok, [], stop=["delta", " gamma"])
    assert d.update(ids, False) == " gamma" and d.output_text == "alpha beta"


def test_multiple_stops_overlapping_batch_invariant(tok):
    """Overlapping stops: the one that completes first wins however tokens are batched."""
    text = "alpha beta gamma delta epsilon"
    ids = tok.encode(text)
    stops = ["beta gamma delta", "gamma"]
    results = set()
    for how in CHUNKINGS:
        d, _, _, got = stream(tok, [], ids, how, stop=stops)
        results.add((got, d.output_text))
    assert results == {("gamma", "alpha beta ")}
    # Same end: the longer (earlier-starting) one.
    d = IncrementalDetokenizer(tok, [], stop=["gamma", "beta gamma"])
    assert d.update(ids, False) == "beta gamma" and d.output_text == "alpha "


def test_include_stop_str_drops_text_after_it_in_same_step(tok):
    ids = tok.encode("one two three four")
    d = IncrementalDetokenizer(tok, [], stop=["two"], include_stop_str_in_output=True)
    assert d.update(ids, False) == "two"
    assert d.output_text == "one two"
    assert d.get_next_output_text(finished=True, delta=False) == "one two"
    # Stopped: further tokens add no text.
    assert d.update(tok.encode(" five"), False) is None and d.output_text == "one two"


def test_hold_back_then_release(tok):
    """While running, len(longest stop) - 1 characters are held back; a request that ends
    without a stop gets them all."""
    text = "abcdef ghijkl"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, [], stop=["xyz!", "q"])
    d.update(ids, False)
    assert d.get_next_output_text(finished=False, delta=False) == text[:-3]
    assert d.get_next_output_text(finished=False, delta=True) == text[:-3]
    assert d.get_next_output_text(finished=True, delta=True) == text[-3:]
    assert d.get_next_output_text(finished=True, delta=False) == text


def test_partial_stop_streamed_only_if_it_never_completes(tok):
    """A prefix of a stop string is held back; if the stop then fails to complete, the text
    flows out and nothing was retracted."""
    text = "say hello wor... no, hello world!"
    ids = tok.encode(text)
    d, deltas, final, got = stream(tok, [], ids, stop=["hello world"])
    assert got == "hello world" and d.output_text == "say hello wor... no, "
    for prefix in streamed_prefixes(deltas):
        assert d.output_text.startswith(prefix)
    assert "".join(deltas) + final == d.output_text


def test_stop_in_text_before_eos_same_step(tok):
    """A stop string completed before the terminating EOS of the same step still cuts."""
    ids = tok.encode("first. STOP here") + [IM_END]
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert d.update(ids, True) == "STOP"
    assert d.output_text == "first. "


@pytest.mark.parametrize("how", ["one", "random"])
def test_long_output_with_stop(tok, chat_prompt, how):
    """Several thousand characters (the text store folds its tail into the head every ~1k
    characters) with the stop string far in."""
    body = "".join(TEXTS[k] for k in sorted(TEXTS)) * 12
    text = body + " then STOP_HERE and a tail"
    ids = tok.encode(text)
    d, deltas, final, got = stream(tok, chat_prompt, ids, how, stop=["STOP_HERE", "\x00"])
    assert got == "STOP_HERE" and d.output_text == body + " then "
    assert "".join(deltas) + final == d.output_text
    assert all(FFFD not in x for x in deltas)


# ------------------------------------------------------------------ cost


def test_per_token_cost(tok, chat_prompt):
    ids = (tok.encode(TEXTS["code"] + TEXTS["cjk"] + TEXTS["emoji"]) * 40)[:1000]
    d = IncrementalDetokenizer(tok, chat_prompt, stop=["never appears"])
    t0 = time.perf_counter()
    deltas = []
    for i in ids:
        d.update([i], False)
        deltas.append(d.get_next_output_text(finished=False, delta=True))
    per_token = (time.perf_counter() - t0) / len(ids)
    print(f"\nIncrementalDetokenizer: {per_token * 1e6:.1f} us/token over {len(ids)} tokens")
    deltas.append(d.get_next_output_text(finished=True, delta=True))
    assert "".join(deltas) == d.output_text == tok.decode(ids)
    assert per_token < 500e-6  # loose: a shared 2-core CPU; typical is ~10 us


def _first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(begin, end) of the stop string token-by-token decoding sees first: the earliest end,
    then the earliest begin."""
    found = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    if not found:
        return None
    end, begin = min(found)
    return begin, end


@pytest.mark.parametrize("seed", range(40))
def test_many_stop_strings_cut_where_the_first_one_ends(tok, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(5, 80)))
    stops = list({"".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 6)))
                  for _ in range(rng.randint(1, 30))})
    ids = tok.encode(text)
    include = rng.random() < 0.5
    d = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    reason = None
    for piece in chunks(ids, "random", seed):
        reason = d.update(piece, False) or reason
        if reason is not None:
            break
    d.finish()
    full = tok.decode(ids)
    want = _first_stop(full, stops)
    if want is None:
        assert d.stop_reason is None and d.output_text == full
    else:
        begin, end = want
        assert d.stop_reason == full[begin:end], (full, stops)
        assert d.output_text == full[:end if include else begin]


def test_stop_matching_costs_the_same_for_10000_strings(tok):
    """One automaton over the new text, not a search per string: 10,000 stop strings (none of
    which occurs) cost about what one does, per token."""
    text = "the quick brown fox jumps over the lazy dog, " * 40
    ids = tok.encode(text)
    many = [f"never-{i:05d}" for i in range(10_000)]

    def per_token_updates(stops: list[str]) -> float:
        d = IncrementalDetokenizer(tok, [], stop=stops)  # builds the automaton
        start = time.perf_counter()
        for t in ids:
            assert d.update([t], False) is None
        return time.perf_counter() - start

    one = min(per_token_updates(["never"]) for _ in range(3))
    lots = min(per_token_updates(many) for _ in range(3))
    assert lots < 3 * one + 0.05, (lots, one)
