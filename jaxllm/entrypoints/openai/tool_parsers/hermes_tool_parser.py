"""The `hermes` tool-call format, which Qwen2.5's chat template asks for: each call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The parser reads the model's text as it streams: text outside the tags is content, a call's name
is announced as soon as its header (`{"name": ..., "arguments": `) is complete, and its
arguments follow in pieces. The non-streaming result is the same parser fed the whole text at
once, so a streamed call reassembles to exactly the non-streamed one. `arguments` is the model's
own JSON text (what the client will `json.loads`), without the object's closing brace.

A tag whose body has no well-formed header (not JSON, no name) is kept as content, tags and all.
A whole text whose calls' arguments are not JSON is all content (`extract_tool_calls`); a stream
cannot take back what it sent, so there such a call's pieces have already gone out as a call.
When calls were made, whitespace at the end of the content (the newlines between and after the
calls) is dropped; without calls the content is the text as generated.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The call's header up to its arguments value; the lookahead makes the match independent of how
# the text was chunked (whitespace before the value belongs to the header either way).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `message.tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """One streamed piece of call `index`: its first carries id and name, later ones an
    arguments piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's `delta.tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class DeltaMessage:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments(rest: str, final: bool) -> str:
    """The arguments text known so far from the body after the header. Until the tag closes,
    everything from the last `}` on is held back: it may be the call object's own closing
    brace (and the whitespace before it is held with it)."""
    if final:
        text = rest.rstrip()
        return text[:-1].rstrip() if text.endswith("}") else text
    end = rest.rfind("}")
    return rest[:end].rstrip() if end >= 0 else ""


class HermesToolParser:
    """Incremental parser of one choice's text: `feed` each new piece, then `finish`.

    `complete_calls_only` (where a grammar forces the calls): a call is reported once its
    closing tag is in, whole, and a call the text ends inside (cut by max_tokens) is dropped,
    markup and all: a stream never sends a call the whole reply would not contain."""

    def __init__(self, complete_calls_only: bool = False) -> None:
        self.complete_calls_only = complete_calls_only
        self.tool_calls: list[ToolCall] = []
        self._buf = ""  # text not yet classified (a possible tag prefix, or an open call's)
        self._inside = False
        self._body = ""  # the open tag's text so far
        self._header_end: int | None = None  # where the open call's arguments start
        self._held_ws = ""  # content's trailing whitespace, emitted once more content follows

    def feed(self, text: str) -> DeltaMessage:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                i = self._buf.find(TOOL_CALL_START)
                if i < 0:
                    keep = _partial_suffix(self._buf, TOOL_CALL_START)
                    content.append(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(TOOL_CALL_START):]
                self._inside, self._body, self._header_end = True, "", None
                continue
            j = self._buf.find(TOOL_CALL_END)
            if j < 0:
                keep = _partial_suffix(self._buf, TOOL_CALL_END)
                self._body += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                calls += self._progress(final=False)
                break
            self._body += self._buf[:j]
            self._buf = self._buf[j + len(TOOL_CALL_END):]
            calls += self._progress(final=True)
            if self._header_end is None:  # no call: the tag stays text
                content.append(TOOL_CALL_START + self._body + TOOL_CALL_END)
            self._inside = False
        return DeltaMessage(self._content("".join(content)), calls)

    def finish(self) -> DeltaMessage:
        """The end of the text: an unclosed call ends where the text does."""
        content = ""
        calls: list[ToolCallDelta] = []
        if self._inside and self.complete_calls_only:
            self._inside = False  # an unfinished call: dropped
        elif self._inside:
            self._body += self._buf
            calls = self._progress(final=True)
            if self._header_end is None:
                content = TOOL_CALL_START + self._body
            self._inside = False
        else:
            content = self._buf
        self._buf = ""
        content = self._content(content)
        if not self.tool_calls:
            content += self._held_ws
        self._held_ws = ""
        return DeltaMessage(content, calls)

    def _content(self, text: str) -> str:
        text = self._held_ws + text
        end = len(text.rstrip())
        self._held_ws = text[end:]
        return text[:end]

    def _progress(self, final: bool) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        if self.complete_calls_only and not final:
            return out
        if self._header_end is None:
            m = _HEADER.match(self._body)
            if m is None:
                return out
            try:
                name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return out
            self._header_end = m.end()
            call = ToolCall(make_tool_call_id(), name)
            self.tool_calls.append(call)
            out.append(ToolCallDelta(len(self.tool_calls) - 1, "", call.id, name))
        call = self.tool_calls[-1]
        args = _arguments(self._body[self._header_end:], final)
        assert args.startswith(call.arguments), "streamed arguments must only grow"
        if len(args) > len(call.arguments):
            out.append(ToolCallDelta(len(self.tool_calls) - 1, args[len(call.arguments):]))
            call.arguments = args
        return out


def extract_tool_calls(text: str, complete_calls_only: bool = False) -> ExtractedToolCalls:
    """The calls in a whole generated text, and the content around them (None when empty).
    When a call's arguments are not JSON, the whole text is content and no call is reported:
    a client would fail to `json.loads` them. `complete_calls_only`: see HermesToolParser."""
    parser = HermesToolParser(complete_calls_only)
    content = parser.feed(text).content + parser.finish().content
    for call in parser.tool_calls:
        try:
            json.loads(call.arguments)
        except json.JSONDecodeError:
            return ExtractedToolCalls(False, [], text or None)
    return ExtractedToolCalls(bool(parser.tool_calls), parser.tool_calls, content or None)


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool,
                      whitespace_flexible: bool, tags_are_tokens: bool,
                      max_calls: int | None = None) -> str:
    """An llguidance Lark grammar whose sentences are one call (several, newline-separated, with
    `parallel`: at most `max_calls` when given) of one of `functions` ({"name", "parameters"}),
    arguments valid against the function's parameters schema; the text may end after any
    complete call. `tags_are_tokens`: the tokenizer has <tool_call> and </tool_call> as tokens
    of their own (Qwen2.5's), which the grammar then names as tokens, since the model emits them
    as such."""
    start, end = ((TOOL_CALL_START, TOOL_CALL_END) if tags_are_tokens
                  else (json.dumps(TOOL_CALL_START), json.dumps(TOOL_CALL_END)))
    if not parallel or max_calls == 1:
        first = "start: tool_call"
    elif max_calls is None:
        first = 'start: tool_call ("\\n" tool_call)*'
    else:
        first = f'start: tool_call ("\\n" tool_call){{0,{max_calls - 1}}}'
    lines = [first,
             "tool_call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        header = '\n{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
        schema: dict[str, Any] = dict(fn.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", {"whitespace_flexible": whitespace_flexible})
        lines.append(f'call_{i}: {start} {json.dumps(header, ensure_ascii=False)} args_{i} '
                     f'"}}\\n" {end}')
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines)
