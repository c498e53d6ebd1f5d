"""Per-request token statistics for the repetition, frequency and presence penalties, kept up
to date by each new token (vLLM rebuilds them every step on the GPU; on the host, rebuilding
from the prompt and outputs costs time that grows with the sequence)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class PenaltyState:
    """Tokens seen in the prompt or output (repetition) and each output token's count
    (frequency, presence). Arrays are rebuilt only when a token appears for the first time."""

    def __init__(self, prompt_token_ids: Iterable[int] = (),
                 output_token_ids: Iterable[int] = ()) -> None:
        self._prompt = {int(t) for t in prompt_token_ids}
        self._seen_extra: list[int] = []  # output tokens not in the prompt, first-seen order
        self._counts: dict[int, int] = {}
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        for t in output_token_ids:
            self.append(t)

    def append(self, token: int) -> None:
        token = int(token)
        count = self._counts.get(token)
        if count is None:
            self._counts[token] = 1
            if token not in self._prompt:
                self._seen_extra.append(token)
            self._arrays = None
        else:
            self._counts[token] = count + 1
            if self._arrays is not None:
                ids, counts, seen = self._arrays
                counts[int(np.searchsorted(ids, token))] += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(distinct output ids, sorted; their counts as float32; ids seen in prompt or output)."""
        if self._arrays is None:
            ids = np.fromiter(sorted(self._counts), np.int64, len(self._counts))
            counts = np.fromiter((self._counts[t] for t in ids.tolist()), np.float32, len(ids))
            seen = np.fromiter([*self._prompt, *self._seen_extra], np.int64,
                               len(self._prompt) + len(self._seen_extra))
            self._arrays = (ids, counts, seen)
        return self._arrays
