"""NgramProposer: draft tokens for speculative decoding looked up in the request itself.

Prompt lookup decoding needs no draft model: it finds the latest earlier occurrence of a
request's last n tokens (the longest n in [prompt_lookup_min, prompt_lookup_max] that occurs)
and proposes the tokens that followed it. It pays off where the output repeats its input (code
edits, summaries, answers quoting a document).

The engine core asks for drafts after every step, for every running request, so the lookup is
on the critical path. It is numpy over all the listed requests at once: each request's tokens
live in a row of a preallocated array (like the model runner's input batch), and one pass per
n-gram length compares every position of every row with that row's suffix; no Python loop
visits a request or a position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


class NgramProposer:
    """Prompt lookup decoding (vLLM's NgramProposer): for a request with tokens x[0..L-1], the
    draft is the (at most `num_speculative_tokens`) tokens that follow the latest earlier match
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
        tokens = self.token_ids_cpu[rows, :width]
        batch = np.arange(len(rows))
        # match[b, e]: the last n tokens of row b also end at position e, for n = 1, 2, ...
        # grown by one position back per n. Only ends e <= L - 2 count (the match is followed
        # by a token of the sequence), so the stale tail of a row never matches.
        match = np.arange(width) <= (lens - 2)[:, None]
        found = np.zeros(len(rows), bool)
        end = np.zeros(len(rows), np.intp)
        # A longer n-gram than width - 1 has no earlier occurrence in any row.
        for n in range(1, min(self.prompt_lookup_max, width - 1) + 1):
            back = n - 1
            # Rows shorter than n read a clipped index: they have no candidate end left.
            suffix_token = tokens[batch, np.maximum(lens - n, 0)]
            match[:, :back] = False
            match[:, back:] &= tokens[:, :width - back] == suffix_token[:, None]
            if n < self.prompt_lookup_min:
                continue
            # The latest end: the first True of the reversed row.
            last = width - 1 - np.argmax(match[:, ::-1], axis=1)
            hit = match[batch, last]
            if not hit.any():
                break  # no row matches n tokens, so none matches more
            end = np.where(hit, last, end)  # a longer n replaces a shorter one
            found |= hit
        k = self.num_speculative_tokens
        start = end + 1
        num_draft = np.where(found, np.minimum(lens - start, k), 0)
        idx = np.minimum(start[:, None] + np.arange(k), width - 1)
        drafts = tokens[batch[:, None], idx].tolist()
        return [d[:c] for d, c in zip(drafts, num_draft.tolist(), strict=True)]


def _as_token_ids(request_id: str, token_ids: Sequence[int]) -> np.ndarray:
    try:
        tokens = np.asarray(token_ids)
    except (TypeError, ValueError):
        tokens = None
    if tokens is None or tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise ValueError(f"token ids of request {request_id!r} must be a flat sequence of "
                         f"ints, got {type(token_ids).__name__} "
                         + ("" if tokens is None else f"of shape {tokens.shape}, {tokens.dtype}"))
    if tokens.size and (tokens.min() < 0 or tokens.max() > _INT32_MAX):
        raise ValueError(f"token ids of request {request_id!r} must be in [0, {_INT32_MAX}], "
                         f"got values from {tokens.min()} to {tokens.max()}")
    return tokens
