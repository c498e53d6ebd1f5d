"""Incremental detokenizing and stop strings for one sequence (vLLM's v1 detokenizer, our shape).

How text is produced
--------------------
Each step decodes only a short window of token ids, ``ids[prefix:]``, with the tokenizer's own
decoder (the Rust ``tokenizers`` backend when there is one, else ``tokenizer.decode``). The text
of ``ids[prefix:read]`` was already emitted; its length is cached, so the new text is
``decode(ids[prefix:])[prefix_len:]`` -- the prefix-offset / read-offset scheme of vLLM's
``detokenize_incrementally``. Left context (``ids[prefix:read]``, seeded from the last prompt
tokens) makes tokens that decode differently at a sequence start, or that continue a character
begun before them, come out as they do inside the whole sequence.

We decode the window ourselves rather than use ``tokenizers.decoders.DecodeStream`` because:
a batch of new tokens (several per step) costs one decode, not one call per token; at the end of a
request the bytes still held back can be flushed (DecodeStream has no flush, so a request that
ends mid-character, or on a genuine U+FFFD, loses that text); and we choose how a run of bytes
that never completes is bounded. Per token this costs one Rust decode of at most ~20 ids (a few
microseconds); the window slides forward every ``_SLIDE_AT`` tokens.

UTF-8 safety (the U+FFFD rule)
------------------------------
Byte-level BPE splits a multi-byte character across tokens; a decode that stops inside it ends
with U+FFFD. Text is only ever committed up to a token boundary ``cut`` whose decoded text ``t``
can no longer change:

* ``t`` does not end with U+FFFD (it ends on a complete character), or
* ``t`` ends with U+FFFD, the decode of the whole window starts with ``t`` and is longer: the bytes
  that follow have already decided that U+FFFD (an invalid sequence, or a real U+FFFD character).

Otherwise the trailing tokens are held. So a character split over tokens is never emitted as
U+FFFD; a U+FFFD appears mid-stream only where ``tokenizer.decode`` of the whole output has one
too. At the end of the request (:meth:`finish`, ``get_next_output_text(finished=True)``, or
``update(..., stop_terminated=True)``) whatever is still held is decoded as is, so a request that
ends on an incomplete character or on a U+FFFD gets the same U+FFFD that ``tokenizer.decode``
gives. Safety valve: if more than ``_MAX_PENDING`` tokens stay held (only pathological output
does that), they are committed as decoded.

Prompt boundary: as in vLLM, output text is what the decode grows by past the prompt. A character
that starts in the prompt's last token and is completed by the first output token belongs to the
prompt's text and is not part of the output (``tokenizer.decode(output_ids)`` would show its
continuation bytes as U+FFFD instead).

Stop strings
------------
After each update, the newly committed text goes through one Aho-Corasick automaton of all the
stop strings (built once per list and shared by the requests that use it), whose state carries
over from the previous update: the cost is per new character, whatever the number of stop
strings. Among the matches, the one that ends first wins (ties: the one that starts first, the
longest); this is the one token-by-token decoding would have seen first, so the result does not
depend on how many tokens arrive per step. The output is cut before the match
(or right after it with ``include_stop_str_in_output``). Unlike vLLM, stop strings are also
checked on the text before a terminating EOS / stop token of the same step (a stop string that
completed before the stop token is the earlier event).

Streaming hold-back: unless ``include_stop_str_in_output``, :meth:`get_next_output_text` keeps
the last ``max(len(stop)) - 1`` characters back until the request finishes, so a stop string
spanning steps is never streamed and then retracted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

_FFFD = "\ufffd"
# Prompt tokens kept as left context for the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT = 5
# Once the emitted part of the window is longer than this many tokens, the window start moves
# up to the previous read offset.
_SLIDE_AT = 16
# How many cut points (from the end) are tried when the window's text ends with U+FFFD. With
# tokens of one byte or more, an incomplete character lies within the last 3 tokens.
_MAX_CUT_TRIES = 8
# Text kept apart from the long head of the output before being appended to it.
_FOLD_AT = 1024
# More held tokens than this are committed as decoded (pathological output only).
_MAX_PENDING = 64


class StopMatcher:
    """An Aho-Corasick automaton of stop strings: fed text a character at a time, it reports
    the longest stop string ending at each character, in time independent of how many there
    are."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        # State 0 is the empty string; goto[s][ch] the state of s's string + ch.
        self.goto: list[dict[str, int]] = [{}]
        longest = [0]  # length of the stop string spelled by each state, 0 if none
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = self.goto[state][ch] = len(self.goto)
                    self.goto.append({})
                    longest.append(0)
                state = nxt
            longest[state] = len(stop)
        # fail[s]: the state of the longest proper suffix of s's string that is a prefix of a
        # stop string; best[s]: the longest stop string that is a suffix of s's string.
        self.fail = [0] * len(self.goto)
        self.best = list(longest)
        order = list(self.goto[0].values())
        for state in order:  # breadth first: a state's fail state is done before it
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                target = self.goto[f].get(ch, 0)
                self.fail[nxt] = target if target != nxt else 0
                self.best[nxt] = longest[nxt] or self.best[self.fail[nxt]]
                order.append(nxt)

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Consume `text` from `state`: (the state after it, 0) when no stop string ends in
        it, else (the state at the first character that ends one, where that character is in
        `text` + 1, the longest stop string's length ending there)."""
        goto, fail, best = self.goto, self.fail, self.best
        for i, ch in enumerate(text):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if best[state]:
                return state, i + 1, best[state]
        return state, 0, 0


@functools.lru_cache(maxsize=64)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """One automaton per stop list, shared by the requests (n > 1 children) that use it."""
    return StopMatcher(stops)


def _make_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer",
                                                                        None)
    cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
    if backend is not None and hasattr(backend, "decode") and not cleanup:
        # What PreTrainedTokenizerFast.decode runs, minus the Python-side overhead.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text of one generated sequence, built token by token; stop strings; streaming deltas."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self.stop = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Characters held back from streaming while unfinished.
        self.stop_max_len = max((len(s) for s in self.stop), default=0)
        self.stop_buffer_length = (self.stop_max_len - 1
                                   if self.stop and not include_stop_str_in_output else 0)
        # The stop string that ended the text (None while none has).
        self.stop_reason: str | None = None
        self._stop_matcher = stop_matcher(tuple(self.stop)) if self.stop else None
        self._stop_state = 0  # the automaton's state after the text so far

        self._token_ids: list[int] = []
        # output_text == _head + _recent. New text is appended to the short _recent, which is
        # folded into _head every _FOLD_AT characters: appending to one long str would copy
        # the whole text every token.
        self._head = ""
        self._recent = ""
        self._len = 0
        self._stream_offset = 0
        self._finished = False
        # Decode window: ids[:read] is left context / text already emitted (its decode is
        # prefix_len characters long), ids[read:] is held back. The window starts at the
        # "prefix offset"; tokens before it are dropped from the list.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._ids)
        self._last_read = 0
        self._prefix_len = len(self._decode(self._ids)) if self._ids else 0

    # ---------------------------------------------------------------- public API

    @property
    def output_text(self) -> str:
        """All text committed so far (held-back bytes of an incomplete character excluded until
        :meth:`finish`), cut at a matched stop string."""
        if self._recent:
            self._head += self._recent
            self._recent = ""
        return self._head

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def window_size(self) -> int:
        """Tokens the next update decodes again with its new ones (the window that keeps the
        per-token cost flat however long the output grows)."""
        return len(self._ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append newly sampled tokens (may be several). Returns the stop string that matched
        (the caller then finishes the request with finish_reason "stop", stop_reason = that
        string), else None.

        stop_terminated: the request just ended on an EOS / stop token id (the last of
        new_token_ids); that token's text is not added unless include_stop_str_in_output, and
        any held-back bytes are flushed (the request is over).
        """
        self._token_ids.extend(new_token_ids)
        if self.stop_reason is not None or self._finished:
            return None
        to_decode = new_token_ids
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        start = self._len
        if to_decode:
            self._ids.extend(to_decode)
            self._advance()
        if stop_terminated:
            self._flush()
            self._finished = True
        return self._check_stop(start)

    def finish(self) -> None:
        """The request is over (any reason): decode the held-back tail as it is. Idempotent.
        A stop string completed by that tail still cuts the text (see :attr:`stop_reason`)."""
        if self._finished:
            return
        self._finished = True
        if self.stop_reason is None:
            start = self._len
            self._flush()
            self._check_stop(start)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Streaming: the full text, or (delta) only the part not returned before. While not
        finished, the last ``max(len(stop)) - 1`` characters are held back so a stop string
        spanning tokens is never streamed then retracted. ``finished=True`` calls
        :meth:`finish` first."""
        if finished:
            self.finish()
        hold = 0 if finished else self.stop_buffer_length
        length = max(self._len - hold, 0)
        if not delta:
            return self.output_text[:length]
        begin = self._stream_offset
        if begin >= length:
            return ""
        self._stream_offset = length
        return self._tail(begin)[:length - begin]

    # ---------------------------------------------------------------- internals

    def _commit(self, cut: int, text: str) -> None:
        """ids[:cut] decodes to ``text``; emit its new part and move the read offset there."""
        new = text[self._prefix_len:]
        if new:
            self._recent += new
            self._len += len(new)
            if len(self._recent) > _FOLD_AT:
                self._head += self._recent
                self._recent = ""
        self._last_read, self._read = self._read, cut
        self._prefix_len = len(text)
        if self._read > _SLIDE_AT and self._last_read > 0:
            # Slide the window start to the previous read offset (a committed boundary), as
            # vLLM's prefix offset does, keeping at least one token of left context.
            drop = self._last_read
            del self._ids[:drop]
            self._read -= drop
            self._last_read = 0
            self._prefix_len = len(self._decode(self._ids[:self._read]))

    def _advance(self) -> None:
        ids = self._ids
        end = len(ids)
        if end == self._read:
            return
        text = self._decode(ids)
        if not text.endswith(_FFFD):
            self._commit(end, text)
            return
        # The window ends inside a character (or on a U+FFFD): commit up to the last cut
        # whose text can no longer change.
        lowest = max(self._read + 1, end - _MAX_CUT_TRIES)
        for cut in range(end - 1, lowest - 1, -1):
            t = self._decode(ids[:cut])
            if not t.endswith(_FFFD) or (len(text) > len(t) and text.startswith(t)):
                self._commit(cut, t)
                return
        if end - self._read > _MAX_PENDING:
            self._commit(end, text)

    def _flush(self) -> None:
        if len(self._ids) > self._read:
            self._commit(len(self._ids), self._decode(self._ids))

    def _check_stop(self, start: int) -> str | None:
        """Feed the text added since ``start`` to the stop automaton (committed text only
        grows until a stop string cuts it, so the automaton's state carries over)."""
        if self._stop_matcher is None or self._len == start:
            return None
        self._stop_state, at, length = self._stop_matcher.feed(self._stop_state,
                                                               self._tail(start))
        if not at:
            return None
        end = start + at
        begin = end - length
        keep = self.output_text[:end if self.include_stop_str_in_output else begin]
        stop = self.output_text[begin:end]
        self._head, self._recent, self._len = keep, "", len(keep)
        self.stop_reason = stop
        return stop

    def _tail(self, pos: int) -> str:
        """output_text[pos:], without joining the whole text."""
        in_head = pos - len(self._head)
        if in_head >= 0:
            return self._recent[in_head:]
        return self._head[pos:] + self._recent
