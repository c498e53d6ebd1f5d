"""NgramProposer: draft tokens for speculative decoding looked up in the request itself.

Prompt lookup decoding needs no draft model: it finds the earliest occurrence of a
request's last n tokens (the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs)
and proposes the tokens that followed it. It pays off where the output repeats its input (code
edits, summaries, answers quoting a document).

The engine core asks for drafts after every step, for every running request, so the lookup is
on the critical path. It is numpy over all the listed requests at once: each request's tokens
live in a row of a preallocated array (like the model runner's input batch), and each n-gram
length takes one pass that compares every position of every row with one more token of that
row's suffix; no Python loop visits a request or a position.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class NgramProposer:
    """Prompt lookup decoding (vLLM's NgramProposer): for a request with tokens x[0..L-1], the
    draft is the (at most `num_speculative_tokens`) tokens that follow the earliest match
    of its suffix x[L-n:L], for the longest n in [prompt_lookup_min, prompt_lookup_max] that
    matches. A match ends before the last token, so it is never the suffix itself and at least
    one token follows it; drafts stop at the end of the sequence. No match: no draft."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, max_model_len: int, max_num_seqs: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"prompt_lookup_min={prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # Rows are reused without clearing: a row's tokens past its length are stale, and
        # propose never reads them.
        self.token_ids_cpu = np.zeros((max_num_seqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_seqs, np.int32)
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    @property
    def num_requests(self) -> int:
        """Requests tracked now."""
        return len(self._rows)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._rows

    def add_request(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Start tracking a request with all its tokens so far (prompt, plus outputs after a
        preemption). An id already tracked is replaced."""
        tokens = _as_token_ids(request_id, token_ids)
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {request_id!r} has {len(tokens)} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        row = self._rows.get(request_id)
        if row is None:
            if not self._free_rows:
                raise ValueError(f"cannot track request {request_id!r}: already tracking "
                                 f"max_num_seqs={self.max_num_seqs} requests")
            row = self._free_rows.pop()
            self._rows[request_id] = row
        self.token_ids_cpu[row, :len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)

    def append(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens just accepted for it (one or more)."""
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"cannot append to request {request_id!r}: it is not tracked")
        tokens = _as_token_ids(request_id, token_ids)
        start = int(self.num_tokens[row])
        end = start + len(tokens)
        if end > self.max_model_len:
            raise ValueError(f"request {request_id!r} would have {end} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        self.token_ids_cpu[row, start:end] = tokens
        self.num_tokens[row] = end

    def remove(self, request_id: str) -> None:
        """Forget it (finished, aborted, preempted); unknown ids are ignored."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.num_tokens[row] = 0
            self._free_rows.append(row)

    def propose(self, request_ids: Sequence[str]) -> list[list[int]]:
        """Draft tokens for each listed request (possibly empty lists), vectorized over them."""
        try:
            rows = np.array([self._rows[r] for r in request_ids], np.intp)
        except KeyError as e:
            raise ValueError(f"cannot propose for request {e.args[0]!r}: it is not tracked") \
                from None
        if len(rows) == 0:
            return []
        lens = self.num_tokens[rows].astype(np.intp)
        width = int(lens.max())
        if width <= self.prompt_lookup_min:
            return [[] for _ in range(len(rows))]  # too short for a match and a token after it
        # The rows read backwards from the longest one's end, contiguous: rev[b, c] =
        # x[width - 1 - c], so a row's earliest match is its last True.
        rev = self.token_ids_cpu[rows, width - 1::-1]
        batch = np.arange(len(rows))
        # match[b, c]: the last n tokens of row b also end at position e = width - 1 - c, for
        # n = 1, 2, ..., one more token compared per n. Only ends e <= L - 2 count (a token of
        # the sequence follows the match), so a row's stale tail never matches.
        match = np.arange(width, dtype=np.int32) >= (width + 1 - lens).astype(np.int32)[:, None]
        found = np.zeros(len(rows), bool)
        end = np.zeros(len(rows), np.intp)
        # No row has an earlier occurrence of more than width - 1 tokens.
        for n in range(1, min(self.prompt_lookup_max, width - 1) + 1):
            back = n - 1
            # x[L - n]; rows shorter than n read a clipped index, but have no candidate left.
            suffix_token = rev[batch, np.minimum(width - 1 - lens + n, width - 1)]
            if back:
                match[:, width - back:] = False  # the n tokens would start before x[0]
            match[:, :width - back] &= rev[:, back:] == suffix_token[:, None]
            if n < self.prompt_lookup_min:
                continue
            first = width - 1 - np.argmax(match[:, ::-1], axis=1)  # the earliest end
            hit = match[batch, first]
            if not hit.any():
                break  # no row matches n tokens, so none matches more
            end = np.where(hit, width - 1 - first, end)  # a longer n replaces a shorter one
            found |= hit
        k = self.num_speculative_tokens
        start = end + 1
        num_draft = np.where(found, np.minimum(lens - start, k), 0)
        idx = np.minimum(start[:, None] + np.arange(k), self.max_model_len - 1)
        drafts = self.token_ids_cpu[rows[:, None], idx].tolist()
        return [d[:c] for d, c in zip(drafts, num_draft.tolist(), strict=True)]


def _as_token_ids(request_id: str, token_ids: Sequence[int]) -> np.ndarray:
    """The ids as a flat int array; ValueError naming the request unless each is in [0, 2**31)."""
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError):  # ragged nesting
        tokens = np.asarray(None)
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"token ids of request {request_id!r} must be a flat sequence of "
                         f"ints, got {reprlib.repr(token_ids)}")
    if tokens.size:
        # Builtins are far cheaper than numpy reductions on the few tokens of a step.
        low, high = ((min(token_ids), max(token_ids)) if isinstance(token_ids, list)
                     else (tokens.min(), tokens.max()))
        if low < 0 or high > _INT32_MAX:
            raise ValueError(f"token ids of request {request_id!r} must be in "
                             f"[0, {_INT32_MAX}], got values from {low} to {high}")
    return tokens
