"""Sampling from the device's top-K candidates, vectorized over rows, and the rule saying when
that gives exactly what the full row would.

The full-row sampler (`sampler.py`) weighs and draws a candidate set through
`candidate_weights` and `inverse_cdf` too,
so a row sampled from its top-K and the same row sampled from its full logits go through the
same float operations on the same values in the same order: identical tokens, seeded or not.

The candidates are the row's K largest values, sorted by value then token id; which tokens
tied at the K-th value made it is unspecified. So a cut is safe only strictly above the K-th
value (or when the K candidates are the whole vocabulary). Exact when the row needs no logits
processing (bias, penalties, min_tokens), its top-N logprobs (if any) end strictly above the
K-th value, and:
  - greedy: the top value lies strictly above the K-th: candidate 0 is numpy's argmax;
  - 0 < top_k < K and the K-th value lies strictly below the top_k-th: every token tied with
    the top_k-th (the sampler keeps ties, as vLLM does) is among the candidates;
  - min_p whose threshold lies strictly above the K-th value: every token it keeps is a
    candidate. top_p on top of either only narrows the set.
A sampled token's rank counts the tokens with a larger logit, all of them candidates too.

A constrained row (structured outputs) samples from its candidates with the disallowed ones at
-inf (`mask_candidates`), while the bound stays the ORIGINAL K-th value: every token outside the
candidates, allowed or not, lies at or below it. The rules above then apply to the masked values
(greedy: the best allowed candidate strictly above the bound; top_k: the top_k-th allowed one;
min_p: its threshold from the best allowed one), so the masked candidates sample exactly what
the masked full row would, and never a disallowed token. Logprobs stay raw (the unmasked
candidates). When no rule holds (e.g. every candidate is masked) the row takes the full path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.metadata import SamplingMetadata


@dataclass
class TopKLogits:
    """What the device returns per sampled row besides the full logits."""

    values: np.ndarray  # [R, K] float32, descending; ties lower token id first
    token_ids: np.ndarray  # [R, K] int32
    lse: np.ndarray  # [R] float32: log-sum-exp of the row's raw logits
    complete: bool = False  # K is the vocabulary size: every token is a candidate

    def rows(self, index: np.ndarray) -> TopKLogits:
        return TopKLogits(self.values[index], self.token_ids[index], self.lse[index],
                          self.complete)


def min_p_threshold(zmax: float, temperature: float, min_p: float) -> np.float32:
    """Logit threshold of min_p: p_i >= min_p * p_max <=> z_i >= z_max + T * log(min_p).
    float32 so that every path compares float32 logits against the same number."""
    return np.float32(zmax + temperature * math.log(min_p))


def mask_candidates(topk: TopKLogits, rows: np.ndarray, bitmask: np.ndarray) -> TopKLogits:
    """The candidates with those of `rows` that `bitmask` (one int32 bit row per entry of
    `rows`: bit t set = token t allowed) disallows at -inf, each row sorted again by value
    (ties keep their token order): what the sampler draws from for constrained rows. The other
    rows are unchanged; `lse` stays the raw one."""
    vals, ids = topk.values.copy(), topk.token_ids.copy()
    sub_ids = ids[rows].astype(np.int64)
    words = bitmask[np.arange(len(rows))[:, None], np.minimum(sub_ids >> 5, bitmask.shape[1] - 1)]
    allowed = ((words >> (sub_ids & 31)) & 1).astype(bool) & (sub_ids < 32 * bitmask.shape[1])
    masked = np.where(allowed, vals[rows], np.float32(-np.inf)).astype(np.float32)
    order = np.argsort(-masked, axis=1, kind="stable")
    vals[rows] = np.take_along_axis(masked, order, 1)
    ids[rows] = np.take_along_axis(ids[rows], order, 1)
    return TopKLogits(vals, ids, topk.lse, topk.complete)


def exact_rows(metadata: SamplingMetadata, processed: np.ndarray,
               topk: TopKLogits, masked: TopKLogits | None = None) -> np.ndarray:
    """Which rows the candidates sample exactly (see the module docstring). `processed`: the
    rows that need logits processing this step (besides a grammar's mask). `masked`: the
    candidates the rows draw from when some are constrained (`mask_candidates`); `topk` keeps
    the raw ones, which give the bound and the logprobs."""
    raw = topk.values
    num, k_max = raw.shape
    rows = np.arange(num)
    # Values a cut must lie strictly above; -inf when the candidates are the whole vocabulary.
    last = np.full(num, -np.inf, np.float32) if topk.complete else raw[:, k_max - 1]
    num_logprobs = metadata.num_logprobs
    logprobs_ok = (num_logprobs <= 0) | (
        (num_logprobs <= k_max) & (raw[rows, np.clip(num_logprobs - 1, 0, k_max - 1)] > last))
    vals = raw if masked is None else masked.values
    top_k = metadata.top_k
    top_k_ok = ((top_k > 0) & (top_k < k_max)
                & (last < vals[rows, np.clip(top_k - 1, 0, k_max - 1)]))
    min_p_ok = last < metadata.min_p_thresholds(vals[:, 0])  # -inf threshold where none
    random_ok = top_k_ok | min_p_ok
    return ~processed & logprobs_ok & np.where(metadata.greedy, vals[:, 0] > last, random_ok)


def candidate_weights(z: np.ndarray, valid: np.ndarray, zmax: np.ndarray,
                      temperature: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Draw weights of candidate logits z [n, W] (float32, in token-id order, `valid` marking
    each row's candidates): exp((z - zmax) / T) in float64, then top_p (vLLM's rule: keep the
    largest weights until their sum reaches top_p of the total; ties at the cut in token
    order). Cut and invalid entries weigh 0. Sums are sequential cumulative sums, which zero
    entries do not change, so a row's weights do not depend on W or on its padding."""
    w = np.exp((z.astype(np.float64) - zmax.astype(np.float64)[:, None])
               / temperature[:, None])
    w *= valid
    cut = np.flatnonzero(top_p < 1.0)
    if cut.size:
        wc = w if cut.size == len(w) else w[cut]
        s = -np.sort(-wc, axis=1)
        cum = np.cumsum(s, axis=1)
        target = top_p[cut] * cum[:, -1]
        keep = np.count_nonzero(cum < target[:, None], axis=1) + 1
        thr = s[np.arange(len(s)), keep - 1][:, None]
        mask = wc >= thr
        # More than `keep` at or above the cut only with ties at it: keep the first in token
        # order (rare: a per-row fix).
        for r in np.flatnonzero(np.count_nonzero(mask, axis=1) > keep):
            ties = np.flatnonzero(wc[r] == thr[r, 0])
            mask[r, ties[keep[r] - np.count_nonzero(wc[r] > thr[r, 0]):]] = False
        wc = wc * mask
        if cut.size == len(w):
            w = wc
        else:
            w[cut] = wc
    return w


def inverse_cdf(w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row of weights w [n, W] (float64), the column where the sequential cumulative weight
    first exceeds u * total; never a zero-weight column."""
    cum = np.cumsum(w, axis=1)
    target = u * cum[:, -1]
    col = np.minimum(np.count_nonzero(cum <= target[:, None], axis=1), w.shape[1] - 1)
    for r in np.flatnonzero(~(w[np.arange(len(w)), col] > 0)):  # float rounding at the end
        pos = np.flatnonzero(w[r] > 0)
        before = pos[pos <= col[r]]
        col[r] = before[-1] if before.size else pos[0]
    return col


def sample_from_topk(topk: TopKLogits, metadata: SamplingMetadata, u: np.ndarray,
                     masked: TopKLogits | None = None
                     ) -> tuple[np.ndarray, np.ndarray, list[LogprobsLists | None]]:
    """Sample every row from its candidates (all rows exact, see `exact_rows`); `u` holds each
    random row's uniform draw (ignored for greedy rows). `masked`: the candidates to draw from
    when rows are constrained (`mask_candidates`); logprobs come from `topk`, raw.

    Returns (token ids [R], sampled logprobs [R] (raw, device normaliser), logprob rows)."""
    raw_vals, raw_ids = topk.values, topk.token_ids
    if masked is not None:
        topk = masked
    vals, ids, lse = topk.values, topk.token_ids, topk.lse
    num, k_max = vals.shape
    col = np.zeros(num, dtype=np.intp)
    tokens = ids[:, 0].astype(np.int64)
    rand = np.flatnonzero(~metadata.greedy)
    if rand.size:
        n = rand.size
        rand_metadata = metadata if n == num else metadata.rows(rand)
        z = vals if n == num else vals[rand]
        zmax = z[:, 0]
        # Per row: top_k's cut (the top_k-th value; ties stay) and min_p's threshold, float32
        # as the full-row sampler compares them; -inf where the row has neither.
        top_k = rand_metadata.top_k
        top_k = np.where((top_k > 0) & (top_k < k_max), top_k, 0)
        cut = np.where(top_k > 0, z[np.arange(n), top_k - 1], np.float32(-np.inf))
        cut = np.maximum(cut, rand_metadata.min_p_thresholds(zmax))
        valid = z >= cut[:, None]
        rand_ids = ids if n == num else ids[rand]
        # Values are descending, so each row's candidates are a prefix: columns past the
        # longest are zero weights everywhere, which change no sum (candidate_weights).
        width = int(np.count_nonzero(valid, axis=1).max())
        if width < k_max:
            z, valid, rand_ids = z[:, :width], valid[:, :width], rand_ids[:, :width]
        order = np.argsort(rand_ids, axis=1)  # ids are distinct: any sort gives token order
        w = candidate_weights(np.take_along_axis(z, order, 1),
                              np.take_along_axis(valid, order, 1), zmax,
                              rand_metadata.temperature, rand_metadata.top_p)
        c = order[np.arange(n), inverse_cdf(w, np.asarray(u, np.float64)[rand])]
        tokens[rand] = rand_ids[np.arange(n), c]
        col[rand] = c
    chosen = vals[np.arange(num), col].astype(np.float64)
    sampled_logprobs = (chosen - lse.astype(np.float64)).astype(np.float32)
    logprobs: list[LogprobsLists | None] = [None] * num
    for i in np.flatnonzero(metadata.num_logprobs >= 0).tolist():
        top = int(metadata.num_logprobs[i])
        row_ids = [int(tokens[i])] + raw_ids[i, :top].tolist()
        row_vals = [float(chosen[i])] + raw_vals[i, :top].tolist()
        lse_i = float(lse[i])
        rank = int(np.count_nonzero(raw_vals[i] > raw_vals.dtype.type(chosen[i]))) + 1
        logprobs[i] = LogprobsLists([row_ids], [[v - lse_i for v in row_vals]],
                                    [[rank] + list(range(1, top + 1))])
    return tokens, sampled_logprobs, logprobs
