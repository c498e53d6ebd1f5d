"""Logprobs as arrays: what the sampler computes and the engine core sends, one row per scored
position. The frontend turns rows into the `{token_id: Logprob}` dicts users see."""

from __future__ import annotations

import msgspec

from jaxllm.outputs import Logprob


class LogprobsLists(msgspec.Struct, array_like=True):
    """Row i scores one position: `token_ids[i][0]` is the token that was sampled there (or, for
    prompt logprobs, the prompt's next token), followed by the top-N tokens, ranks 1..N, of the
    raw distribution. `logprobs` and `ranks` are aligned with `token_ids` (rank 1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[list[int]]

    def __len__(self) -> int:
        return len(self.token_ids)

    def to_dicts(self) -> list[dict[int, Logprob]]:
        """One dict per row: the top-N tokens in rank order, then the scored token if it is not
        among them (vLLM's layout)."""
        out = []
        for ids, lps, ranks in zip(self.token_ids, self.logprobs, self.ranks, strict=True):
            row = {t: Logprob(logprob=lp, rank=r)
                   for t, lp, r in zip(ids[1:], lps[1:], ranks[1:], strict=True)}
            if ids[0] not in row:
                row[ids[0]] = Logprob(logprob=lps[0], rank=ranks[0])
            out.append(row)
        return out
