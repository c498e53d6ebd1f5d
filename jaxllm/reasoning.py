"""Reasoning parsers: a thinking model's `<think>...</think>` text -> the chat message's
`reasoning_content`, the rest its `content` (vLLM's `--reasoning-parser`).

- `qwen3`: an answer that starts with `<think>` reasons up to `</think>`; any other answer is
  content (Qwen3 with `enable_thinking: false`, whose template closes the think block in the
  prompt).
- `deepseek_r1`: the answer reasons up to `</think>` (a leading `<think>` dropped; DeepSeek-R1's
  and Qwen3-Thinking-2507's templates open the block in the prompt); without `</think>` all of
  it is reasoning.

The newlines right after `</think>` are dropped from the content. One state machine serves both
a whole answer and a stream (`feed` each delta, then `finish`), so the stream's pieces join to
the whole answer's split. Text that may be the start of a tag is held back until the next delta
tells.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} (known: "
                             f"{', '.join(REASONING_PARSERS)})")
        self.name = name
        self._state = "start"  # start -> reasoning -> content
        self._buffer = ""
        self._after_end = False

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += text
        if self._state == "start":
            if THINK_START.startswith(self._buffer):
                return out  # the tag may still come
            if self._buffer.startswith(THINK_START):
                self._buffer = self._buffer[len(THINK_START):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.name == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = self._buffer.find(THINK_END)
            if end < 0:
                keep = _held(self._buffer, THINK_END)
                out.reasoning = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            out.reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(THINK_END):]
            self._state = "content"
            self._after_end = True
        if self._after_end:
            # The newlines that follow the block are not the answer's (Qwen's templates
            # strip them when they render the conversation back).
            self._buffer = self._buffer.lstrip("\n")
            self._after_end = not self._buffer
        out.content, self._buffer = self._buffer, ""
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back, once the answer has ended."""
        rest, self._buffer = self._buffer, ""
        if self._state == "start":
            self._state = "reasoning" if self.name == "deepseek_r1" else "content"
            if rest == THINK_START:
                return ReasoningDelta()
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)


def extract_reasoning(text: str, name: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning or None when it has none, content)."""
    parser = ReasoningParser(name)
    a, b = parser.feed(text), parser.finish()
    reasoning = a.reasoning + b.reasoning
    started = text.startswith(THINK_START) or (name == "deepseek_r1" and bool(text))
    return (reasoning if reasoning or started else None), a.content + b.content
