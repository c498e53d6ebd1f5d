"""The reasoning parsers (jaxllm/reasoning.py): whole answers against
a hand-written table, and any stream of any answer, cut anywhere, against a reference split
written here with str.partition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    extract_reasoning,
)

CASES = [
    # text, qwen3's (reasoning, content), deepseek_r1's
    ("<think>plan</think>\n\nanswer", ("plan", "answer"), ("plan", "answer")),
    ("plain answer", (None, "plain answer"), ("plain answer", "")),
    ("<think>cut short", ("cut short", ""), ("cut short", "")),
    ("opened in the prompt</think>answer", (None, "opened in the prompt</think>answer"),
     ("opened in the prompt", "answer")),
    ("", (None, ""), (None, "")),
    ("<thin", (None, "<thin"), ("<thin", "")),
    ("<think></think>x", ("", "x"), ("", "x")),
    ("<think>a</think>\n\n\nb\n</think>", ("a", "b\n</think>"), ("a", "b\n</think>")),
    (" <think>a</think>b", (None, " <think>a</think>b"), (" <think>a", "b")),
]


@pytest.mark.parametrize("text, qwen3, r1", CASES)
def test_whole_answers(text, qwen3, r1):
    assert extract_reasoning(text, "qwen3") == qwen3
    assert extract_reasoning(text, "deepseek_r1") == r1


def reference(text: str, name: str) -> tuple[str, str]:
    """(reasoning, content) as the stream joins them ('' for no reasoning)."""
    opened = text.startswith("<think>")
    if not opened and name == "qwen3":
        return "", text
    body = text[len("<think>"):] if opened else text
    reasoning, end, content = body.partition("</think>")
    return reasoning, content.lstrip("\n") if end else ""


PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "</thi", "nk>",
                          "\n", "\n\n", "a", "b c", ">"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.lists(st.integers(1, 6), min_size=1, max_size=40),
       st.sampled_from(REASONING_PARSERS))
def test_any_stream_joins_to_the_reference_split(pieces, cuts, name):
    text = "".join(pieces)
    parser = ReasoningParser(name)
    reasoning = content = ""
    i = k = 0
    while i < len(text):
        j = i + cuts[k % len(cuts)]
        delta = parser.feed(text[i:j])
        reasoning += delta.reasoning
        content += delta.content
        i, k = j, k + 1
    end = parser.finish()
    reasoning += end.reasoning
    content += end.content
    assert (reasoning, content) == reference(text, name)
    whole = extract_reasoning(text, name)
    assert (whole[0] or "", whole[1]) == (reasoning, content)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'r2' \(known: qwen3, "
                                         r"deepseek_r1\)"):
        ReasoningParser("r2")
