"""Speculative decoding's verification (vLLM's RejectionSampler): a request's d draft tokens
against the target model's d + 1 logits rows of one step.

Row j scores the position after draft j (row 0: after the request's last accepted token), so
it is processed exactly as a non-speculative step would process it had drafts 1..j been
sampled: penalties and min_tokens count them, its structured-output mask is the matcher's after
them. Then, in order:
- greedy: draft j + 1 is accepted while it equals row j's argmax; the first mismatch emits the
  argmax instead (the correction); all accepted: row d's argmax is the bonus token. The output
  is exactly what non-speculative greedy decoding emits from the same logits.
- random: the target distribution p_j of row j is what the sampler draws from (temperature,
  min_p, top-k, top-p over the processed logits). Rejection sampling (Leviathan et al. 2023;
  Chen et al. 2023) accepts draft t with probability min(1, p_j(t) / q_j(t)), q_j being the
  proposer's distribution, and on rejection draws from the residual max(0, p_j - q_j),
  renormalised; all accepted, a bonus token comes from p_d. Every emitted token is then
  distributed as p. For drafts without a distribution (n-gram: q_j is a point mass at t) both
  steps take one uniform u: the token x that inverting p_j's cumulative weights at u gives, as
  the sampler without drafts would draw it; t is accepted when x == t (probability p_j(t)), else
  x is emitted (distributed as p_j without t, renormalised: the residual). So each emitted token
  takes exactly one draw from the request's generator, as without drafts: a seeded request
  gives the same tokens with or without speculation, whatever its batch, from the same logits.
  With a draft distribution, the acceptance test and the residual draw take one draw each.
Logprobs are the raw distribution's (as for non-speculative rows), one per emitted token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.penalties import PenaltyState
from jaxllm.sample.sampler import (
    SamplingRow,
    _exp_row,
    _logprob_row,
    _lse,
    _process_row,
    draw_token,
    empty_row_reason,
    sampling_candidates,
)
from jaxllm.sample.token_mask import TokenMask


@dataclass
class VerifiedTokens:
    """One request's verification: the accepted drafts, then one correction or bonus token."""

    token_ids: list[int]
    # Raw logprob of each emitted token under its row's unprocessed distribution.
    sampled_logprobs: list[float]
    # One row per emitted token when the request asked for logprobs, else None.
    logprobs: LogprobsLists | None
    num_accepted: int
    # Why a position's processing left no token to sample (sampler.empty_row_reason): the
    # request cannot go on past the drafts accepted before it (`token_ids`, no token after
    # them), as it would have stopped there without speculation.
    error: str | None = None


def _target(z: np.ndarray, row: SamplingRow, buf: np.ndarray
            ) -> tuple[np.ndarray | None, np.ndarray]:
    """The row's target distribution as (token ids or None for the whole vocabulary, weights),
    unnormalised, from its processed logits."""
    return sampling_candidates(z, row.params, buf)


def _weight_of(cand: np.ndarray | None, w: np.ndarray, token: int) -> float:
    if cand is None:
        return float(w[token]) if 0 <= token < w.shape[0] else 0.0
    hit = np.flatnonzero(cand == token)
    return float(w[hit[0]]) if hit.size else 0.0


def _row_at(row: SamplingRow, drafts: Sequence[int], j: int,
            mask: TokenMask | None) -> SamplingRow:
    """The sampling row of position j: as if drafts[:j] had been sampled."""
    if not j:
        return replace(row, mask=mask)
    output = list(row.output_token_ids) + list(drafts[:j])
    penalties = None
    if row.penalties is not None:
        penalties = PenaltyState(row.prompt_token_ids, output)
    return replace(row, output_token_ids=output, penalties=penalties, mask=mask)


def verify(logits: np.ndarray, draft_token_ids: Sequence[int], row: SamplingRow, *,
           masks: Sequence[TokenMask | None] | None = None,
           draft_probs: np.ndarray | None = None,
           lse: np.ndarray | None = None,
           all_sampled_logprobs: bool = True) -> VerifiedTokens:
    """Verify one request's drafts.

    logits: [d + 1, vocab] raw rows (row j after draft j); `row`: the request's sampling row
    before the drafts (its penalty state is read, not changed). masks: structured outputs'
    mask per position; a list shorter than d + 1 means the draft at its last position is not
    allowed there, so nothing after it can be accepted. draft_probs: [d, vocab] the proposer's
    distribution per draft, None for point masses (n-gram). lse: the rows' raw log-sum-exp when
    the device computed it; without it, all_sampled_logprobs=False leaves `sampled_logprobs`
    NaN unless the request asked for logprobs (as `sampler.sample`).
    """
    x = np.asarray(logits, np.float32)
    d = len(draft_token_ids)
    if x.ndim != 2 or x.shape[0] != d + 1:
        raise ValueError(f"verify: logits of shape {x.shape} for {d} drafts (want {d + 1} rows)")
    params = row.params
    want_logprobs = params.logprobs is not None
    want_sampled_logprobs = all_sampled_logprobs or want_logprobs
    vocab = x.shape[1]
    raw_buf = np.empty(vocab, np.float32)
    work_buf = np.empty(vocab, np.float32)
    tokens: list[int] = []
    sampled: list[float] = []
    rows = LogprobsLists([], [], []) if want_logprobs else None
    num_accepted = 0
    for j in range(d + 1):
        mask = None
        if masks is not None:
            if j >= len(masks):
                break  # unreachable: the previous draft was refused by the grammar
            mask = masks[j]
        raw = np.ascontiguousarray(x[j])
        row_j = _row_at(row, draft_token_ids, j, mask)
        z = _process_row(raw, row_j)
        why = empty_row_reason(z, row_j)
        if why is not None:
            return VerifiedTokens(tokens, sampled, rows, num_accepted, error=why)
        logits_j = raw if z is None else z
        draft = int(draft_token_ids[j]) if j < d else None
        if params.greedy:
            tok = int(np.argmax(logits_j))
            accept = draft is not None and tok == draft
        else:
            generator = row.generator
            if generator is None:
                raise ValueError("verify: a random-sampling row needs a generator")
            cand, w = _target(logits_j, row, work_buf)
            if draft is None:
                tok, accept = draw_token(cand, w, float(generator.random())), False
            elif draft_probs is None:
                tok = draw_token(cand, w, float(generator.random()))
                accept = tok == draft
            else:
                total = float(np.sum(w, dtype=np.float64))
                p_t = _weight_of(cand, w, draft) / total
                q = np.asarray(draft_probs[j], np.float64)
                q_t = float(q[draft])
                # u < p/q, written so a zero q never divides (a draft of probability 0 under
                # its own proposer is never accepted).
                accept = float(generator.random()) * q_t < p_t
                if accept:
                    tok = draft
                else:
                    tok = _draw_residual(cand, w / total, q, float(generator.random()))
        if accept:
            tok = draft
            num_accepted += 1
        assert tok is not None
        tokens.append(tok)
        row_lse = float(lse[j]) if lse is not None else None
        if row_lse is None and want_sampled_logprobs:
            m = float(raw.max())
            row_lse = _lse(_exp_row(raw, raw_buf, m)) if math.isfinite(m) else m
        # The raw log-normaliser costs a pass over the vocabulary: only when someone reads it.
        sampled.append(math.nan if row_lse is None else float(raw[tok]) - row_lse)
        if rows is not None:
            assert row_lse is not None and params.logprobs is not None  # want_logprobs
            ids, lps, ranks = _logprob_row(raw, row_lse, params.logprobs, tok)
            rows.token_ids.append(ids)
            rows.logprobs.append(lps)
            rows.ranks.append(ranks)
        if not accept:
            break
    return VerifiedTokens(tokens, sampled, rows, num_accepted)


def _draw_residual(cand: np.ndarray | None, p: np.ndarray, q: np.ndarray, u: float) -> int:
    """Draw from max(0, p - q), renormalised (p: the target's normalised weights over `cand`).
    If nothing is left (p == q, which a rejection makes a zero-probability event), p itself."""
    res = np.maximum(p.astype(np.float64) - (q if cand is None else q[cand]), 0.0)
    if not np.any(res > 0.0):
        res = p.astype(np.float64)
    return draw_token(cand, res, u)
