"""Host-side sampler: logits rows (numpy) -> token ids and logprobs, following vLLM V1's order.

Per row, in order (vLLM's `Sampler.forward`):

1. raw log-softmax statistics of the unprocessed logits (vLLM's default `raw_logprobs`): the
   sampled token's logprob and the requested top-N logprobs come from these, so a constrained
   row reports the model's own distribution, not the one its grammar left;
2. the structured-output mask (`SamplingRow.mask`) and `allowed_token_ids`: disallowed tokens
   -inf, before anything else, so bias, penalties and the draw see only what is allowed;
   then `bad_words` (`banned_tokens`: the last token of each bad-word sequence whose prefix
   ends the output) -inf; then logit_bias added;
3. min_tokens: while fewer than `min_tokens` tokens were generated, the row's eos ids and its
   `stop_token_ids` are set to -inf (vLLM masks every stop id, eos included, even with ignore_eos);
4. penalties: repetition (tokens seen in prompt or output: positive logits divided, negative
   multiplied), then frequency and presence (output tokens only:
   `logit -= frequency * count + presence * (count > 0)`);
5. greedy rows (temperature < 1e-5): argmax of the processed logits, no random draw;
6. random rows: temperature, then min_p (relative to the top probability), then top_k, then
   top_p over what is left renormalised (vLLM V1 applies min_p before top-k/top-p), then one
   uniform draw `generator.random()` inverted through the kept tokens' cumulative weights.

Each random row draws exactly one number from its own generator per sampled token, so a seeded
request's stream depends only on its seed and its own logits, never on the batch company.

Cost: each row's full vocabulary is touched a few times per step (max or argmax, one exp pass
for the raw log-normaliser, one tempered exp pass or threshold pass for random rows), and never
sorted whole in the common cases:
- top-k and top-N logprob candidates come from a threshold found on a strided subsample (exact:
  it falls back to np.partition when that threshold keeps fewer than k);
- top-p without top-k/min_p takes the tokens within 1e-3 of the top probability, else a threshold
  estimated from a subsample, checked exactly, and sorts the values of that set only (the whole
  row only when both fall short);
- cumulative sums over the vocabulary go through 1024-wide block sums (one matrix-vector
  product) and one block's cumsum: numpy's cumsum is sequential, slow over 151936 floats.
Rows are handled one at a time with preallocated vocabulary-sized buffers: a [R, vocab] float32
temporary falls out of cache and measured slower than per-row passes that stay in it
(docs/perf/host-path.md), and each
per-row numpy call covers 151936 elements, so the Python loop costs little.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from jaxllm.sample.candidates import candidate_weights, inverse_cdf, min_p_threshold
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.penalties import PenaltyState
from jaxllm.sample.token_mask import TokenMask
from jaxllm.sampling_params import SamplingParams

# Top-p without other truncation: first look only at tokens whose probability is at least this
# fraction of the top token's; if they hold less than top_p of the mass, take the whole vocabulary.
TOP_P_PREFILTER = 1e-3
# Strided subsample used to find a cheap lower bound for the k-th largest logit.
_SUBSAMPLE_STRIDE = 16


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what its request contributes to the processing."""

    params: SamplingParams
    generator: np.random.Generator | None   # per request; may be None for greedy rows
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()    # generated so far (penalties, min_tokens)
    eos_token_ids: frozenset[int] = frozenset()  # masked with stop_token_ids during min_tokens
    # The request's penalty statistics, kept by the engine; None: built from the token ids above.
    penalties: PenaltyState | None = None
    # Structured outputs: the tokens the grammar allows next; None: no constraint.
    mask: TokenMask | None = None


@dataclass
class SamplerOutput:
    token_ids: np.ndarray            # [R] int64
    # [R] float32: the sampled token's logprob under the raw distribution (cumulative_logprob);
    # NaN for rows without `logprobs` when sample(..., all_sampled_logprobs=False).
    sampled_logprobs: np.ndarray
    # Per row: the sampled token with its true rank, then the top-`params.logprobs` tokens
    # (ranks 1..N), raw distribution, as one LogprobsLists row; None where params.logprobs is None.
    logprobs: list[LogprobsLists | None]
    # Rows whose processing left no token to sample (`empty_row_reason`): row -> why. Their
    # token id is a placeholder; the request cannot go on.
    errors: dict[int, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Logits processing (allowed tokens, bad words, bias, min_tokens, penalties)


def banned_tokens(bad_words: Sequence[Sequence[int]] | None,
                  output_token_ids: Sequence[int]) -> list[int]:
    """vLLM V1's bad-words rule: for each bad-word token sequence, its last token when the
    output so far ends with the rest of it (always, for a one-token word). Only output tokens
    count, never the prompt's."""
    if not bad_words:
        return []
    n = len(output_token_ids)
    banned = []
    for word in bad_words:
        k = len(word) - 1
        if k > n:
            continue
        if all(output_token_ids[n - k + i] == word[i] for i in range(k)):
            banned.append(word[-1])
    return banned


def _banned(row: SamplingRow) -> list[int]:
    return banned_tokens(row.params.bad_words_token_ids, row.output_token_ids)


def needs_processing(row: SamplingRow) -> bool:
    return _needs_processing(row, _banned(row))


def _needs_processing(row: SamplingRow, banned: list[int]) -> bool:
    params = row.params
    return bool(row.mask is not None or params.allowed_token_ids or banned or params.logit_bias
                or (params.min_tokens > 0 and len(row.output_token_ids) < params.min_tokens)
                or params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                or params.presence_penalty != 0.0)


def _ids_in_vocab(ids: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < vocab)]


def empty_row_reason(z: np.ndarray | None, row: SamplingRow) -> str | None:
    """Why the processed row `z` leaves no token to sample (every entry -inf), naming what
    of the request excluded them; None when some token is left."""
    if z is None or bool((z > -np.inf).any()):
        return None
    params = row.params
    causes = [name for name, on in (
        ("the structured-output constraint", row.mask is not None),
        ("allowed_token_ids", bool(params.allowed_token_ids)),
        ("bad_words", bool(params.bad_words_token_ids)),
        ("min_tokens (which masks the stop tokens)",
         params.min_tokens > 0 and len(row.output_token_ids) < params.min_tokens),
        ("logit_bias", bool(params.logit_bias))) if on]
    return f"no token is left to sample: {' and '.join(causes) or 'its logits'} exclude every " \
           f"token at this position"


def _process_row(raw: np.ndarray, row: SamplingRow) -> np.ndarray | None:
    """The processed copy of one raw logits row, or None when nothing applies to it."""
    banned = _banned(row)
    if not _needs_processing(row, banned):
        return None
    params = row.params
    vocab = raw.shape[0]
    z = np.array(raw, dtype=np.float32, copy=True) if row.mask is None else row.mask.apply(raw)
    if params.allowed_token_ids:
        allowed = _ids_in_vocab(params.allowed_token_ids, vocab)
        kept = z[allowed]
        z.fill(-np.inf)
        z[allowed] = kept
    if banned:
        z[_ids_in_vocab(banned, vocab)] = -np.inf
    bias = params.logit_bias
    if bias:
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        if ids.max() >= vocab:
            raise ValueError(f"SamplingParams.logit_bias has token id {int(ids.max())} outside "
                             f"the vocabulary of {vocab}, got {bias!r}")
        vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        z[ids] += vals
    if params.min_tokens > 0 and len(row.output_token_ids) < params.min_tokens:
        stop_ids = set(params.stop_token_ids or ()) | set(row.eos_token_ids)
        if stop_ids:
            z[_ids_in_vocab(sorted(stop_ids), vocab)] = -np.inf
    if (params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0):
        return z
    state = row.penalties
    if state is None:
        state = PenaltyState(row.prompt_token_ids, row.output_token_ids)
    out_ids, counts, seen = state.arrays()
    out_ok = (out_ids >= 0) & (out_ids < vocab)
    out_ids, counts = out_ids[out_ok], counts[out_ok]
    if params.repetition_penalty != 1.0:
        seen = seen[(seen >= 0) & (seen < vocab)]
        v = z[seen]
        z[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if out_ids.size and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        # Distinct ids: frequency once per occurrence (count), presence once per token.
        z[out_ids] -= (np.float32(params.frequency_penalty) * counts
                       + np.float32(params.presence_penalty))
    return z


def process_logits(logits: np.ndarray, rows: Sequence[SamplingRow]) -> np.ndarray:
    """[R, vocab] logits after the masks, bad words, logit_bias, min_tokens and penalties
    (before temperature): the logits greedy rows take the argmax of. A copy; `sample` does the
    same row by row."""
    x = np.asarray(logits, dtype=np.float32)
    out = np.array(x, copy=True)
    for i, row in enumerate(rows):
        z = _process_row(x[i], row)
        if z is not None:
            out[i] = z
    return out


# ---------------------------------------------------------------------------------------------
# Reductions without a full-vocabulary cumsum (numpy's cumsum is sequential)

_BLOCK = 1024
_ONES: dict[tuple[int, str], np.ndarray] = {}


def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    ones = _ONES.get((n, dtype.char))
    if ones is None:
        ones = _ONES[(n, dtype.char)] = np.ones(n, dtype=dtype)
    return ones


def _block_sums(w: np.ndarray) -> np.ndarray:
    """float64 sums of consecutive _BLOCK-sized blocks of a contiguous vector (the last one may be
    shorter): one matrix-vector product, float64 from there on."""
    n = w.shape[0]
    nb = n // _BLOCK
    ones = _ones(_BLOCK, w.dtype)
    sums = np.empty(nb + (n % _BLOCK > 0), dtype=np.float64)
    if nb:
        sums[:nb] = w[:nb * _BLOCK].reshape(nb, _BLOCK) @ ones
    if n % _BLOCK:
        sums[nb] = float(w[nb * _BLOCK:] @ ones[:n % _BLOCK])
    return sums


def _cum_search(w: np.ndarray, target: float, side: Literal["left", "right"]) -> int:
    """The first index whose inclusive cumulative sum of w reaches `target` (side "left": >=,
    "right": >), clamped to the last index. Cumulative sums per block first, then in one block."""
    n = w.shape[0]
    if n <= 4 * _BLOCK:
        cum = np.cumsum(w, dtype=np.float64)
        return min(int(np.searchsorted(cum, target, side=side)), n - 1)
    w = np.ascontiguousarray(w)
    cum_b = np.cumsum(_block_sums(w))
    b = min(int(np.searchsorted(cum_b, target, side=side)), cum_b.shape[0] - 1)
    cum = np.cumsum(w[b * _BLOCK:(b + 1) * _BLOCK], dtype=np.float64)
    cum += cum_b[b - 1] if b else 0.0
    return b * _BLOCK + min(int(np.searchsorted(cum, target, side=side)), cum.shape[0] - 1)


def _total(w: np.ndarray) -> float:
    if w.shape[0] <= 4 * _BLOCK or not w.flags.c_contiguous:
        return float(w.sum(dtype=np.float64))
    return float(_block_sums(w).sum())


# ---------------------------------------------------------------------------------------------
# Candidates and the draw


def kth_largest(z: np.ndarray, k: int) -> float:
    """The k-th largest value of z (1-based), without partitioning the whole row when k is small.

    A strided subsample's j-th largest value is a threshold that most likely keeps a few times k
    elements of z; if it keeps at least k, the k-th largest lies above it and only those are
    partitioned. Otherwise (unlucky subsample) the whole row is partitioned. Exact either way.
    """
    n = z.shape[0]
    if k >= n:
        return float(z.min())
    sub = z[::_SUBSAMPLE_STRIDE]
    j = 2 * (-(-k // _SUBSAMPLE_STRIDE)) + 8
    if 4 * k <= n and j < sub.shape[0]:
        thr = np.partition(sub, sub.shape[0] - j)[sub.shape[0] - j]
        cand = z[z >= thr]
        if cand.shape[0] >= k:
            return float(np.partition(cand, cand.shape[0] - k)[cand.shape[0] - k])
    return float(np.partition(z, n - k)[n - k])


def top_indices(z: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of z, largest first (ties: lower index first)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.flatnonzero(z >= kth_largest(z, k))
    order = np.argsort(-z[idx], kind="stable")  # idx ascending: ties keep lower ids first
    return idx[order[:k]]


def _top_p_mask(w: np.ndarray, target: float) -> np.ndarray:
    """Mask of the smallest set of largest weights whose sum reaches `target` (vLLM's top-p: a
    token is kept when the mass strictly above it is below top_p; the top one always is). Ties at
    the cut are taken in index order. Sorts values only, never indices."""
    s = np.ascontiguousarray(np.sort(w)[::-1])
    keep = _cum_search(s, target, "left") + 1
    thr = s[keep - 1]
    mask = w > thr
    need = keep - int(np.count_nonzero(mask))
    if need > 0:
        mask[np.flatnonzero(w == thr)[:need]] = True
    return mask


@dataclass
class _Exp:
    """exp(z - c) of a whole row for some c, with z's max and exp(max - c)."""

    e: np.ndarray
    zmax: float
    emax: float


def sampling_candidates(z: np.ndarray, params: SamplingParams, buf: np.ndarray,
                        cached: _Exp | None = None) -> tuple[np.ndarray | None, np.ndarray]:
    """The tokens a random row may draw and their unnormalised weights.

    Returns (indices, weights): indices None means the whole vocabulary, with `weights` a
    vocabulary-sized float32 array (`buf` or the cache's); otherwise float64 weights per index
    (zero for tokens top_p cut). A top_k or min_p set is weighed by `candidate_weights`, as the
    top-K sampler weighs the device's candidates, so both paths give the same token.
    `cached`: the row's exponentials when the caller has them and temperature is 1.
    """
    vocab = z.shape[0]
    temp = params.temperature
    zmax = float(z.max()) if cached is None else cached.zmax
    if not math.isfinite(zmax):  # everything masked (or inf logits): take the argmax
        return np.array([int(np.argmax(z))]), np.ones(1)

    cand: np.ndarray | None = None
    if params.min_p > 0.0:
        cand = np.flatnonzero(z >= min_p_threshold(zmax, temp, params.min_p))
    k = params.top_k
    if 0 < k < vocab:
        if cand is None:
            cand = np.flatnonzero(z >= kth_largest(z, k))
        elif cand.shape[0] > k:
            zc = z[cand]
            kth = np.partition(zc, zc.shape[0] - k)[zc.shape[0] - k]
            cand = cand[zc >= kth]  # ties with the k-th value stay, as in vLLM

    if cand is not None:
        one = np.ones(1)
        return cand, candidate_weights(z[cand][None], np.ones((1, cand.shape[0]), bool),
                                       np.array([zmax], np.float32), one * temp,
                                       one * params.top_p)[0]

    # No top-k or min_p cut: the whole vocabulary's tempered exponentials.
    if cached is not None:
        e, emax = cached.e, cached.emax
    else:
        e, emax = _exp_scaled(z, 1.0 / temp, zmax, buf)
    if params.top_p >= 1.0:
        return None, e
    target = params.top_p * _total(e)
    cand, w = top_p_candidates(e, emax, target)
    mask = _top_p_mask(w, target)
    return (np.flatnonzero(mask) if cand is None else cand[mask]), w[mask].astype(np.float64)


def top_p_candidates(e: np.ndarray, emax: float, target: float
                      ) -> tuple[np.ndarray | None, np.ndarray]:
    """A prefix-closed subset of the vocabulary (every token at least as likely as any it holds)
    whose mass reaches `target`, to sort instead of the whole row: (indices, weights), or
    (None, e) for the whole row.

    First the tokens within TOP_P_PREFILTER of the top one (enough for peaked distributions);
    if they fall short, a threshold estimated from a strided subsample of the rest, with margin,
    checked exactly."""
    thr = TOP_P_PREFILTER * emax
    cand = np.flatnonzero(e >= thr)
    w = e[cand]
    mass = float(w.sum(dtype=np.float64))
    if mass >= target:
        return cand, w
    sub = e[::_SUBSAMPLE_STRIDE]
    sub = np.sort(sub[sub < thr])[::-1]
    est = np.cumsum(sub, dtype=np.float64) * _SUBSAMPLE_STRIDE
    j = int(np.searchsorted(est, 1.1 * (target - mass), side="left")) + 8
    if j < sub.shape[0]:
        cand = np.flatnonzero(e >= sub[j])
        w = e[cand]
        if float(w.sum(dtype=np.float64)) >= target:
            return cand, w
    return None, e


def draw_token(cand: np.ndarray | None, w: np.ndarray, u: float) -> int:
    """Inverse CDF of the weights at u in [0, 1): the first token whose cumulative weight
    exceeds u * total (in index order). Zero-weight tokens are never returned. A candidate set
    goes through `inverse_cdf` (sequential sums, as the top-K sampler draws); the whole
    vocabulary through block sums (numpy's cumsum over it is sequential and slow)."""
    if cand is not None:
        return int(cand[inverse_cdf(w[None], np.array([u]))[0]])
    j = _cum_search(w, u * _total(w), "right")
    if not w[j] > 0:  # only float rounding at the very end can land here
        pos = np.flatnonzero(w > 0)
        if pos.size:
            before = pos[pos <= j]
            j = int(before[-1]) if before.size else int(pos[0])
    return j


# ---------------------------------------------------------------------------------------------
# Logprobs


def _logprob_row(raw: np.ndarray, lse: float, num: int,
                 token: int) -> tuple[list[int], list[float], list[int]]:
    """`token` with its rank (1 + number of tokens with a strictly larger logit), then the
    top-`num` raw logprobs (ranks 1..num): one LogprobsLists row."""
    top = top_indices(raw, num).tolist()
    ids = [token] + top
    ranks = [int(np.count_nonzero(raw > raw[token])) + 1] + list(range(1, len(top) + 1))
    return ids, [float(raw[t]) - lse for t in ids], ranks


def _exp_scaled(z: np.ndarray, scale: float, zmax: float,
                buf: np.ndarray) -> tuple[np.ndarray, float]:
    """exp(scale * (z - c)) into buf for some c, and its largest value. c = 0 (one pass fewer)
    when scale * max(z) is moderate: nothing overflows, and what underflows is below e^-67 of the
    top token; else c = max(z)."""
    top = scale * zmax
    if -20.0 < top < 80.0:
        if scale == 1.0:
            np.exp(z, out=buf)
        else:
            np.multiply(z, np.float32(scale), out=buf)
            np.exp(buf, out=buf)
        return buf, math.exp(top)
    np.subtract(z, np.float32(zmax), out=buf)
    if scale != 1.0:
        np.multiply(buf, np.float32(scale), out=buf)
    np.exp(buf, out=buf)
    return buf, 1.0


def _exp_row(raw: np.ndarray, buf: np.ndarray, m: float) -> _Exp:
    """The row's exponentials (for its log-normaliser, and for sampling at temperature 1)."""
    e, emax = _exp_scaled(raw, 1.0, m, buf)
    return _Exp(e, m, emax)


def _lse(ex: _Exp) -> float:
    """log-sum-exp of the row `ex` holds."""
    return ex.zmax + math.log(_total(ex.e) / ex.emax)


# ---------------------------------------------------------------------------------------------


def sample(logits: np.ndarray, rows: Sequence[SamplingRow], *, lse: np.ndarray | None = None,
           all_sampled_logprobs: bool = True, u: np.ndarray | None = None) -> SamplerOutput:
    """Sample one token per row. logits: [R, vocab] (float32, or anything numpy casts to it).

    lse: the rows' raw log-sum-exp as the device computed it. When given, it is the normaliser
    of every logprob, so these rows and rows sampled from the device's top-K candidates give
    identical numbers, and every row's sampled logprob is filled. Without it the normaliser is
    computed here, and all_sampled_logprobs=False skips it (one exp pass over the vocabulary)
    for rows whose params.logprobs is None; their sampled_logprobs are NaN then (vLLM reports
    no cumulative_logprob for such requests).

    u: each random row's uniform draw, taken by the caller from the row's generator (the engine
    draws while the step runs); None: drawn here.
    """
    x = np.asarray(logits)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if x.ndim != 2 or x.shape[0] != len(rows):
        raise ValueError(f"logits of shape {x.shape} for {len(rows)} rows")
    num_rows, vocab = x.shape
    token_ids = np.empty(num_rows, dtype=np.int64)
    sampled_logprobs = np.full(num_rows, np.nan, dtype=np.float32)
    logprobs: list[LogprobsLists | None] = [None] * num_rows
    raw_buf = np.empty(vocab, dtype=np.float32)   # exponentials of the raw row
    work_buf = np.empty(vocab, dtype=np.float32)  # tempered exponentials of the processed row
    errors: dict[int, str] = {}

    for i, row in enumerate(rows):
        params = row.params
        raw = np.ascontiguousarray(x[i])
        z = _process_row(raw, row)
        why = empty_row_reason(z, row)
        if why is not None:
            # Nothing may be drawn: the row's draw is not consumed, its token is a placeholder.
            errors[i] = why
            token_ids[i] = 0
            continue
        if lse is not None:
            want_logprobs, row_lse = True, float(lse[i])
        else:
            want_logprobs, row_lse = all_sampled_logprobs or params.logprobs is not None, None
        if params.greedy:
            tok = int(np.argmax(raw if z is None else z))
        elif u is None and row.generator is None:
            raise ValueError(f"row {i}: a random-sampling row needs a generator")
        ex = None
        if row_lse is None and want_logprobs:
            m = float(raw[tok]) if params.greedy and z is None else float(raw.max())
            ex = _exp_row(raw, raw_buf, m) if math.isfinite(m) else None
            row_lse = _lse(ex) if ex is not None else m
        if not params.greedy:
            # exactly one draw per sampled token
            if u is not None:
                draw = float(u[i])
            else:
                assert row.generator is not None  # checked above
                draw = float(row.generator.random())
            cached = ex if (z is None and params.temperature == 1.0) else None
            cand, w = sampling_candidates(raw if z is None else z, params, work_buf, cached)
            tok = draw_token(cand, w, draw)
        token_ids[i] = tok
        if want_logprobs:
            assert row_lse is not None  # set above whenever logprobs are wanted
            sampled_logprobs[i] = float(raw[tok]) - row_lse
            if params.logprobs is not None:
                ids, lps, ranks = _logprob_row(raw, row_lse, params.logprobs, tok)
                logprobs[i] = LogprobsLists([ids], [lps], [ranks])
    return SamplerOutput(token_ids=token_ids, sampled_logprobs=sampled_logprobs, logprobs=logprobs,
                         errors=errors)
