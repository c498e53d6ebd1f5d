"""The hermes tool parser on crafted texts, whole and streamed in every chunking, and the
tool-call grammar checked by llguidance's own matcher over the real Qwen2.5 tokenizer. Oracles:
the texts' known calls (written out by hand) and json.loads of the arguments."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from jaxllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    extract_tool_calls,
    tool_call_grammar,
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}

# (text, [(name, arguments)], content)
CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>',
     [("get_weather", '{"city": "Paris", "unit": "c"}')], None),
    ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, "}{"], "y": {}}}\n'
     '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
     [("a", '{"x": [1, "}{"], "y": {}}'), ("b", "{}")], "Let me look."),
    ('<tool_call>{"name":"c","arguments":{"q":"\\u00e9\\"}"}}</tool_call> Done.',
     [("c", '{"q":"\\u00e9\\"}"}')], " Done."),
    # Escaped quote in the name.
    ('<tool_call>\n{"name": "we\\"ird", "arguments": {"k": 1}}\n</tool_call>',
     [('we"ird', '{"k": 1}')], None),
    # Malformed bodies stay content, tags and all.
    ('<tool_call>\nnot json at all\n</tool_call> and text',
     [], '<tool_call>\nnot json at all\n</tool_call> and text'),
    ('<tool_call>\n{"arguments": {}, "name": "late"}\n</tool_call>',
     [], '<tool_call>\n{"arguments": {}, "name": "late"}\n</tool_call>'),
    # No calls: the text as generated, trailing newlines kept.
    ("Just an answer.\n\n", [], "Just an answer.\n\n"),
    ("a < b and <tool", [], "a < b and <tool"),
    ("", [], None),
    # Cut short (max_tokens): the stream has sent the open call as far as the text goes; the
    # whole text, whose arguments are no JSON, is content.
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1, "b', [("f", '{"a": 1, "b')], None),
    # Arguments that are not JSON: likewise.
    ('<tool_call>\n{"name": "g", "arguments": {"city": Paris}}\n</tool_call>',
     [("g", '{"city": Paris}')], None),
    ('text <tool_call>\n{"na', [], 'text <tool_call>\n{"na'),
]


def _stream(text: str, rng: random.Random) -> tuple[str | None, list[tuple[str, str]], list]:
    """Feed `text` in random pieces; (content, calls, raw deltas) reassembled as a client
    reassembles OpenAI's delta.tool_calls."""
    parser = HermesToolParser()
    content = ""
    calls: dict[int, list[str]] = {}
    deltas = []
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        pieces.append(text[i:i + k])
        i += k
    for msg in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += msg.content
        for d in msg.tool_calls:
            deltas.append(d.to_dict())
            if d.id is not None:
                assert d.index not in calls and d.name is not None and d.arguments == ""
                calls[d.index] = [d.name, ""]
            else:
                calls[d.index][1] += d.arguments
    return content or None, [(n, a) for _, (n, a) in sorted(calls.items())], deltas


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize("text,want_calls,want_content", CASES)
def test_hermes_whole_and_streamed(text, want_calls, want_content):
    got = extract_tool_calls(text)
    if all(_is_json(args) for _, args in want_calls):
        assert [(c.name, c.arguments) for c in got.tool_calls] == want_calls
        assert got.tools_called == bool(want_calls)
        assert got.content == want_content
    else:
        assert not got.tools_called and not got.tool_calls and got.content == text
    for call in got.tool_calls:
        assert call.id.startswith("call_") and len(call.id) > 10
        d = call.to_dict()
        assert d["type"] == "function" and d["function"]["name"] == call.name
    assert len({c.id for c in got.tool_calls}) == len(got.tool_calls)
    rng = random.Random(len(text))
    for _ in range(40):
        content, calls, deltas = _stream(text, rng)
        assert calls == want_calls
        assert content == want_content
        # OpenAI's delta layout: the first piece of a call names it, the others do not.
        for d in deltas:
            assert set(d) in ({"index", "id", "type", "function"}, {"index", "function"})


def test_arguments_of_complete_calls_are_json():
    text = CASES[1][0]
    for call in extract_tool_calls(text).tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.fixture(scope="module")
def ll_tokenizer():
    import llguidance.hf

    from jaxllm.model_executor.model_loader.tiny_model import tiny_qwen2_path
    from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

    tok: Any = load_tokenizer(str(tiny_qwen2_path()))  # a fast tokenizer, as llguidance wants
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=151936, eos_token=[151645, 151643])


def _accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    tok, lt = ll_tokenizer
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar))
    ok = m.consume_tokens(tok.encode(text))
    return bool(ok) and m.is_accepting() and not m.is_error()


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_tool_call_grammar(ll_tokenizer):
    fns = [{"name": "get_weather", "parameters": WEATHER}, {"name": "noop"}]
    one = tool_call_grammar(fns, parallel=False, whitespace_flexible=False,
                            tags_are_tokens=True)
    many = tool_call_grammar(fns, parallel=True, whitespace_flexible=False,
                             tags_are_tokens=True)
    good = _call("get_weather", '{"city":"Oslo","unit":"f"}')
    assert _accepts(ll_tokenizer, one, good)
    assert _accepts(ll_tokenizer, one, _call("noop", "{}"))
    assert not _accepts(ll_tokenizer, one, _call("get_time", "{}"))  # not a tool
    assert not _accepts(ll_tokenizer, one, _call("get_weather", '{"city":"Oslo"}'))
    assert not _accepts(ll_tokenizer, one, _call("get_weather",
                                                 '{"city":"Oslo","unit":"k"}'))
    # Whitespace between JSON tokens only where the grammar allows it.
    assert not _accepts(ll_tokenizer, one, _call("get_weather",
                                                 '{"city": "Oslo", "unit": "f"}'))
    flexible = tool_call_grammar(fns, parallel=False, whitespace_flexible=True,
                                 tags_are_tokens=True)
    assert _accepts(ll_tokenizer, flexible, _call("get_weather",
                                                  '{"city": "Oslo", "unit": "f"}'))
    two = good + "\n" + _call("noop", "{}")
    assert not _accepts(ll_tokenizer, one, two)
    assert _accepts(ll_tokenizer, many, two)
    assert not _accepts(ll_tokenizer, many, "plain text")
    # What the grammar accepts, the parser reads back.
    assert [(c.name, c.arguments) for c in extract_tool_calls(two).tool_calls] == [
        ("get_weather", '{"city":"Oslo","unit":"f"}'), ("noop", "{}")]
    # Tags as plain text, for tokenizers without tool-call tokens of their own.
    text_tags = tool_call_grammar(fns, parallel=False, whitespace_flexible=False,
                                  tags_are_tokens=False)
    assert '"<tool_call>"' in text_tags


def test_tool_call_grammar_bounds_parallel_calls(ll_tokenizer):
    fns = [{"name": "get_weather", "parameters": WEATHER}, {"name": "noop"}]
    two = tool_call_grammar(fns, parallel=True, whitespace_flexible=False,
                            tags_are_tokens=True, max_calls=2)
    calls = [_call("noop", "{}")] * 3
    assert _accepts(ll_tokenizer, two, calls[0])
    assert _accepts(ll_tokenizer, two, "\n".join(calls[:2]))
    assert not _accepts(ll_tokenizer, two, "\n".join(calls))


def test_complete_calls_only_drops_a_cut_call_and_its_markup():
    whole = _call("noop", "{}") + "\n" + _call("get_weather", '{"city":"Oslo","unit":"f"}')
    cut = whole[:len(whole) - 20]
    found = extract_tool_calls(cut, complete_calls_only=True)
    assert [(c.name, c.arguments) for c in found.tool_calls] == [("noop", "{}")]
    assert found.content is None
    # Streamed in any chunking: the same single call, sent whole once its tag closed.
    for size in (1, 3, 7):
        parser = HermesToolParser(complete_calls_only=True)
        deltas = [d for i in range(0, len(cut), size) for d in parser.feed(cut[i:i + size])
                  .tool_calls]
        end = parser.finish()
        assert end.content == "" and not end.tool_calls
        assert [(d.index, d.name, d.arguments) for d in deltas] == [
            (0, "noop", ""), (0, None, "{}")]
    # Without the option (tool_choice "auto"), a cut call's arguments are not JSON: all text.
    assert extract_tool_calls(cut).content == cut
