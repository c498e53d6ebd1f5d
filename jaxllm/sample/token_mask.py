"""TokenMask: the tokens a constrained row may sample next, in the form cheapest to apply to a
full logits row on the host.

A grammar's mask arrives as a bit row (bit t set: token t allowed). Storing -inf through a
boolean mask over the whole vocabulary is branchy and slow when the mask is mixed, so the mask is
turned into the shorter of two index lists, the allowed tokens (few: between JSON keys, inside a
number) or the disallowed ones (few: inside a string), before the row's logits arrive; applying
it is then one copy and one short scatter (docs/structured_outputs.md has the costs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenMask:
    """`ids` lists the allowed tokens when `keep`, else the disallowed ones; every token at or
    past the vocabulary the mask was built for is disallowed."""

    ids: np.ndarray  # int64, ascending
    keep: bool
    vocab: int

    @classmethod
    def from_allowed(cls, allowed: np.ndarray, vocab: int) -> TokenMask:
        """From a bool row (True: allowed) of any length: entries past `vocab` are ignored,
        missing ones are disallowed."""
        allowed = np.asarray(allowed, bool)[:vocab]
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], bool)])
        if 2 * int(np.count_nonzero(allowed)) <= vocab:
            return cls(np.flatnonzero(allowed), True, vocab)
        return cls(np.flatnonzero(~allowed), False, vocab)

    @property
    def allows_any(self) -> bool:
        return bool(self.ids.size) if self.keep else self.ids.size < self.vocab

    @classmethod
    def from_bitmask(cls, bits: np.ndarray, vocab: int) -> TokenMask:
        """From one int32 bit row (llguidance's layout: bit t of the row = token t)."""
        allowed = np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), bitorder="little")
        return cls.from_allowed(allowed.view(bool), vocab)

    def apply(self, raw: np.ndarray) -> np.ndarray:
        """A float32 copy of the row `raw` with every disallowed token at -inf."""
        n = raw.shape[0]
        if self.keep:
            z = np.full(n, -np.inf, np.float32)
            ids = self.ids if n >= self.vocab else self.ids[self.ids < n]
            z[ids] = raw[ids]
            return z
        z = np.array(raw, dtype=np.float32, copy=True)
        z[self.ids[self.ids < n] if n < self.vocab else self.ids] = -np.inf
        z[self.vocab:] = -np.inf
        return z


def allow_token(row: np.ndarray, token_id: int) -> None:
    """Set token `token_id`'s bit in one bitmask row (int32 words, bit t of word t // 32)."""
    row.view(np.uint32)[token_id >> 5] |= np.uint32(1 << (token_id & 31))
