"""Speculative decoding's verification (`rejection_sampler.verify`).

Oracles: for greedy rows, sequential decoding with `sampler.sample`, one row at a time with the
accepted drafts appended to the request's output (what non-speculative decoding would have
done); for random rows, the target distribution written out here with numpy (softmax of the
tempered logits, min_p, top-k, top-p), which the emitted tokens must follow (chi-square, fixed
seeds), with a negative control showing that the statistic rejects a wrong sampler.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from scipy.special import log_softmax

from jaxllm.sample.rejection_sampler import verify
from jaxllm.sample.sampler import SamplingRow, sample
from jaxllm.sample.token_mask import TokenMask
from jaxllm.sampling_params import SamplingParams

# Chi-square p-values below this fail the distribution tests (fixed seeds: no flakes).
P_VALUE_MIN = 1e-6


# ---------------------------------------------------------------------------------------------
# Greedy: exactly sequential decoding


def _sequential(logits: np.ndarray, drafts: list[int], row: SamplingRow,
                masks: list[TokenMask | None] | None) -> tuple[list[int], list[float], list]:
    """Decode row by row with `sample`, the row's output extended by the drafts accepted so
    far; stop at the first token that differs from the draft, or after the bonus row."""
    tokens, sampled, rows = [], [], []
    for j in range(len(drafts) + 1):
        mask = masks[j] if masks is not None else None
        r = SamplingRow(row.params, None, row.prompt_token_ids,
                        list(row.output_token_ids) + drafts[:j], row.eos_token_ids, None, mask)
        out = sample(logits[j:j + 1], [r])
        tok = int(out.token_ids[0])
        tokens.append(tok)
        sampled.append(float(out.sampled_logprobs[0]))
        rows.append(out.logprobs[0])
        if j == len(drafts) or tok != drafts[j]:
            break
    return tokens, sampled, rows


def _drafts_along(logits: np.ndarray, row: SamplingRow, d: int, rng: np.random.Generator,
                  masks: list[TokenMask | None] | None, agree: float) -> list[int]:
    """d drafts that follow sequential greedy decoding with probability `agree` at each
    position, else a random other token: runs of accepted drafts, then a mismatch."""
    drafts: list[int] = []
    for j in range(d):
        mask = masks[j] if masks is not None and j < len(masks) else None
        r = SamplingRow(row.params, None, row.prompt_token_ids,
                        list(row.output_token_ids) + drafts, row.eos_token_ids, None, mask)
        want = int(sample(logits[j:j + 1], [r]).token_ids[0])
        if rng.random() >= agree:
            want = int((want + rng.integers(1, logits.shape[1])) % logits.shape[1])
        drafts.append(want)
    return drafts


GREEDY_CASES = {
    "plain": {},
    "logit_bias": {"logit_bias": {3: 4.0, 17: -3.0, 40: 2.5}},
    "min_tokens": {"min_tokens": 5, "stop_token_ids": [5, 9]},
    "penalties": {"repetition_penalty": 1.7, "frequency_penalty": 0.9, "presence_penalty": 0.6},
    "all": {"logit_bias": {2: 1.5}, "min_tokens": 3, "stop_token_ids": [4],
            "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
@pytest.mark.parametrize("d", [1, 3, 5])
def test_greedy_equals_sequential_decoding(case: str, d: int) -> None:
    rng = np.random.default_rng(100 + d)
    vocab = 64
    params = SamplingParams(temperature=0.0, logprobs=3, **GREEDY_CASES[case])
    num_accepted = []
    for trial in range(40):
        # Few distinct values, so penalties and biases change which token wins.
        logits = rng.normal(0, 1.0, (d + 1, vocab)).astype(np.float32)
        prompt = rng.integers(0, vocab, 6).tolist()
        output = rng.integers(0, vocab, int(rng.integers(0, 3))).tolist()
        row = SamplingRow(params, None, prompt, output, frozenset({9, 11}))
        drafts = _drafts_along(logits, row, d, rng, None, agree=0.8)
        want_tokens, want_sampled, want_rows = _sequential(logits, drafts, row, None)
        got = verify(logits, drafts, row)
        where = f"{case} d={d} trial {trial}"
        assert got.token_ids == want_tokens, where
        assert got.num_accepted == len(want_tokens) - 1, where
        np.testing.assert_allclose(got.sampled_logprobs, want_sampled, rtol=1e-5, atol=1e-5)
        assert got.logprobs is not None
        assert got.logprobs.token_ids == [r.token_ids[0] for r in want_rows], where
        assert got.logprobs.ranks == [r.ranks[0] for r in want_rows], where
        np.testing.assert_allclose(np.array(got.logprobs.logprobs),
                                   np.array([r.logprobs[0] for r in want_rows]),
                                   rtol=1e-5, atol=1e-5)
        # The row's output is read, never extended in place.
        assert list(row.output_token_ids) == output
        num_accepted.append(got.num_accepted)
    # Both a full acceptance (bonus) and a rejection happened, so both branches ran.
    assert max(num_accepted) == d and min(num_accepted) < d


def test_greedy_min_tokens_counts_drafts() -> None:
    # Row j sees drafts 1..j as output: with min_tokens 2 and 1 token generated, row 0 (1 token
    # out) masks the stop id, row 1 (2 tokens out: the draft counts) no longer does.
    stop = 7
    logits = np.zeros((3, 16), np.float32)
    logits[:, stop] = 5.0
    logits[0, 2] = 1.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])
    row = SamplingRow(params, None, [1, 2, 3], [4])
    got = verify(logits, [2, 3], row)
    # Row 0: stop masked, so 2 wins and the draft is accepted; row 1: the stop id wins.
    assert got.token_ids == [2, stop]
    assert got.num_accepted == 1


@pytest.mark.parametrize("num_masks", [None, 1, 2, 3, 4])
def test_greedy_with_token_masks(num_masks: int | None) -> None:
    """Masks per position; a list shorter than d + 1 ends at a position whose draft its mask
    refuses (what the structured-output manager hands over when the grammar refuses a draft)."""
    rng = np.random.default_rng(7 + (num_masks or 0))
    vocab, d = 40, 3
    params = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.2)
    accepted = []
    for trial in range(40):
        logits = rng.normal(0, 2.0, (d + 1, vocab)).astype(np.float32)
        full = [TokenMask.from_allowed(rng.random(vocab) < rng.choice([0.2, 0.8]), vocab)
                for _ in range(d + 1)]
        row = SamplingRow(params, None, [1, 2, 3], [4, 5])
        drafts = _drafts_along(logits, row, d, rng, full, agree=0.85)
        masks: list[TokenMask | None] | None = None
        if num_masks is not None:
            masks = list(full[:num_masks])
            if num_masks <= d:
                # The grammar refused the draft at the last masked position.
                last = num_masks - 1
                allowed = np.ones(vocab, bool)
                allowed[drafts[last]] = False
                allowed &= rng.random(vocab) < 0.7
                allowed[(drafts[last] + 1) % vocab] = True
                masks[last] = TokenMask.from_allowed(allowed, vocab)
        want_tokens, want_sampled, _ = _sequential(logits, drafts, row, masks)
        got = verify(logits, drafts, row, masks=masks)
        assert got.token_ids == want_tokens, (num_masks, trial)
        np.testing.assert_allclose(got.sampled_logprobs, want_sampled, rtol=1e-5, atol=1e-5)
        if num_masks is not None and num_masks <= d:
            assert len(got.token_ids) <= num_masks
            # The token emitted at the refused position is one its mask allows.
            assert len(got.token_ids) < num_masks or \
                got.token_ids[-1] != drafts[num_masks - 1]
        accepted.append(got.num_accepted)
    # One mask refusing the first draft: nothing can be accepted; else some drafts are.
    assert max(accepted) == 0 if num_masks == 1 else max(accepted) > 0


def test_verify_refuses_wrong_row_count() -> None:
    row = SamplingRow(SamplingParams(temperature=0.0), None)
    with pytest.raises(ValueError, match="2 drafts"):
        verify(np.zeros((2, 8), np.float32), [1, 2], row)


def test_random_row_without_generator_is_refused() -> None:
    row = SamplingRow(SamplingParams(temperature=1.0), None)
    with pytest.raises(ValueError, match="generator"):
        verify(np.zeros((2, 8), np.float32), [1], row)


# ---------------------------------------------------------------------------------------------
# Random sampling: every emitted token follows the target distribution


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a random row draws from: softmax(logits / T), then min_p (relative to
    the top probability), then top-k, then top-p over what is left renormalised (a token is kept
    while the mass strictly above it is below top_p)."""
    z = logits.astype(np.float64) / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, bool)
    if params.min_p > 0:
        keep &= p >= params.min_p * p.max()
    if params.top_k > 0:
        kth = np.sort(p[keep])[::-1][min(params.top_k, int(keep.sum())) - 1]
        keep &= p >= kth
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        kept = np.zeros_like(keep)
        kept[order[above < params.top_p]] = True
        p = np.where(kept, p, 0.0)
        p /= p.sum()
    return p


# Rows without ties, so every truncation is unambiguous.
LOGITS = np.array([
    [1.2, 0.3, -0.4, 2.0, 0.9, -1.1, 0.1, 1.6],
    [0.2, 1.7, 0.8, -0.6, 1.1, 0.5, -1.4, 0.0],
    [-0.3, 0.6, 1.9, 0.4, -0.9, 1.3, 0.7, -0.1],
], np.float32)

DIST_CASES = {
    "t0.7": dict(temperature=0.7),
    "t1.3": dict(temperature=1.3),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=0.9, top_p=0.75),
    "min_p": dict(temperature=1.1, min_p=0.2),
    "all": dict(temperature=1.2, top_k=6, top_p=0.9, min_p=0.1),
}
N_RUNS = 20000


def _chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    """Chi-square goodness of fit over the tokens of nonzero probability (the others must
    never appear; asserted by the callers)."""
    support = p > 0
    n = counts[support].sum()
    return float(stats.chisquare(counts[support], n * p[support]).pvalue)


def _run_verifications(params: SamplingParams, q_rows: np.ndarray | None, point_drafts: list[int],
                       seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """N_RUNS verifications of 2 drafts over LOGITS. Point-mass drafts (q_rows None) are the
    fixed `point_drafts`; otherwise each run draws its drafts from q_rows. Returns the counts
    of the first emitted token, of the second emitted token in the runs that accepted the first
    draft, and the fraction of runs that accepted it."""
    vocab = LOGITS.shape[1]
    gen = np.random.default_rng(seed)          # the request's generator
    draft_rng = np.random.default_rng(seed + 1)  # the proposer's
    first = np.zeros(vocab, np.int64)
    second = np.zeros(vocab, np.int64)
    accepted_first = 0
    row = SamplingRow(params, gen, [0, 1], [2])
    for _ in range(N_RUNS):
        if q_rows is None:
            drafts = point_drafts
        else:
            drafts = [int(draft_rng.choice(vocab, p=q_rows[j])) for j in range(2)]
        got = verify(LOGITS, drafts, row, draft_probs=q_rows)
        assert len(got.token_ids) == got.num_accepted + 1
        assert got.token_ids[:got.num_accepted] == drafts[:got.num_accepted]
        first[got.token_ids[0]] += 1
        if got.num_accepted >= 1:
            accepted_first += 1
            second[got.token_ids[1]] += 1
    return first, second, accepted_first / N_RUNS


def _draft_dist(seed: int) -> np.ndarray:
    """A proposer's distribution per draft, far from the target's and with some zeros."""
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(LOGITS.shape[1], 0.7), size=2)
    q[:, 0] = 0.0
    return q / q.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("case", sorted(DIST_CASES))
@pytest.mark.parametrize("drafts", ["point_mass", "draft_probs"])
def test_emitted_tokens_follow_target_distribution(case: str, drafts: str) -> None:
    params = SamplingParams(**DIST_CASES[case])
    p0, p1 = target_probs(LOGITS[0], params), target_probs(LOGITS[1], params)
    # Point-mass drafts: the second most likely token of each row, accepted often but not
    # always, so both the acceptance and the residual draw are exercised.
    point = [int(np.argsort(-p0)[1]), int(np.argsort(-p1)[1])]
    seed = sorted(DIST_CASES).index(case)
    q = None if drafts == "point_mass" else _draft_dist(100 + seed)
    first, second, rate = _run_verifications(params, q, point, seed)
    assert 0.05 < rate < 0.95, rate
    assert first[p0 == 0].sum() == 0 and second[p1 == 0].sum() == 0
    assert _chi2_pvalue(first, p0) > P_VALUE_MIN, (first, p0)
    assert _chi2_pvalue(second, p1) > P_VALUE_MIN, (second, p1)
    if q is None:
        # A point mass is accepted with probability p(draft) exactly.
        assert abs(rate - p0[point[0]]) < 5 * np.sqrt(p0[point[0]] * (1 - p0[point[0]]) / N_RUNS)


def test_chi_square_rejects_a_wrong_sampler() -> None:
    """Negative control: the same statistic and threshold reject the tokens of a verifier that
    redraws from p (not the residual) after a rejection, of a distribution without its
    truncation and of one without its temperature, so the tests above have power."""
    params = SamplingParams(temperature=0.9, top_p=0.75)
    p0 = target_probs(LOGITS[0], params)
    draft = int(np.argsort(-p0)[1])
    rng = np.random.default_rng(11)
    counts = np.zeros_like(p0, dtype=np.int64)
    for _ in range(N_RUNS):
        if rng.random() < p0[draft]:
            counts[draft] += 1
        else:
            counts[rng.choice(p0.shape[0], p=p0)] += 1
    assert _chi2_pvalue(counts, p0) < P_VALUE_MIN
    untruncated = target_probs(LOGITS[0], SamplingParams(temperature=0.9))
    wrong = np.bincount(rng.choice(p0.shape[0], N_RUNS, p=untruncated), minlength=p0.shape[0])
    assert wrong[p0 == 0].sum() > 0  # what the zero-probability checks catch
    cold = target_probs(LOGITS[0], SamplingParams(temperature=0.7))
    untempered = target_probs(LOGITS[0], SamplingParams(temperature=1.0))
    wrong = np.bincount(rng.choice(p0.shape[0], N_RUNS, p=untempered), minlength=p0.shape[0])
    assert _chi2_pvalue(wrong, cold) < P_VALUE_MIN


def test_acceptance_with_q_equal_to_p_and_with_impossible_drafts() -> None:
    params = SamplingParams(temperature=0.8, top_k=5)
    p = np.stack([target_probs(r, params) for r in LOGITS[:2]])
    gen, draft_rng = np.random.default_rng(3), np.random.default_rng(4)
    row = SamplingRow(params, gen)
    for _ in range(500):
        drafts = [int(draft_rng.choice(8, p=p[j])) for j in range(2)]
        got = verify(LOGITS, drafts, row, draft_probs=p)
        assert got.num_accepted == 2 and got.token_ids[:2] == drafts
        assert p[1][got.token_ids[2]] >= 0 and target_probs(LOGITS[2], params)[
            got.token_ids[2]] > 0
    # A draft the target gives probability 0 (cut by top-k) is never accepted, point mass or
    # not, and the token emitted instead is one the target allows.
    cut = int(np.flatnonzero(p[0] == 0)[0])
    q = np.full((2, 8), 1 / 8)
    for draft_probs in (None, q):
        for _ in range(500):
            got = verify(LOGITS, [cut, 1], row, draft_probs=draft_probs)
            assert got.num_accepted == 0 and len(got.token_ids) == 1
            assert p[0][got.token_ids[0]] > 0


@pytest.mark.parametrize("case", sorted(DIST_CASES))
def test_point_mass_drafts_sample_as_without_drafts(case: str) -> None:
    """With n-gram (point-mass) drafts, a seeded row emits exactly the tokens sequential
    sampling with `sample` emits from the same rows and generator stream, taking one draw per
    emitted token, so its stream never depends on which drafts it was given."""
    rng = np.random.default_rng(21)
    vocab, d = 12, 3
    params = SamplingParams(repetition_penalty=1.2, **DIST_CASES[case])
    accepted = []
    for trial in range(200):
        logits = rng.normal(0, 1.5, (d + 1, vocab)).astype(np.float32)
        seed = int(rng.integers(1 << 30))
        ref_gen = np.random.default_rng(seed)
        want: list[int] = []
        for j in range(d + 1):
            r = SamplingRow(params, ref_gen, [1, 2], [3] + want)
            want.append(int(sample(logits[j:j + 1], [r]).token_ids[0]))
        # Drafts: the sequential tokens, some replaced, so runs end at a mismatch.
        drafts = [t if rng.random() < 0.7 else int(rng.integers(vocab)) for t in want[:d]]
        n = next((j for j in range(d) if drafts[j] != want[j]), d) + 1
        gen = np.random.default_rng(seed)
        got = verify(logits, drafts, SamplingRow(params, gen, [1, 2], [3]))
        assert got.token_ids == want[:n], (case, trial)
        # The same draws were taken: the streams go on alike.
        ref_gen = np.random.default_rng(seed)
        for _ in range(n):
            ref_gen.random()
        assert gen.random() == ref_gen.random()
        accepted.append(got.num_accepted)
    assert max(accepted) == d and min(accepted) == 0


def test_seeded_verification_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9)
    runs = []
    for _ in range(2):
        row = SamplingRow(params, np.random.default_rng(1234))
        runs.append([verify(LOGITS, [3, 1], row).token_ids for _ in range(50)])
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------
# Logprobs: the raw distribution's, one row per emitted token


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_raw_rows(temperature: float) -> None:
    rng = np.random.default_rng(5)
    vocab, d, num = 50, 4, 3
    # Processing (bias, penalties, temperature) must not leak into the reported logprobs.
    params = SamplingParams(temperature=temperature, logprobs=num, logit_bias={1: 3.0},
                            repetition_penalty=1.5, seed=1 if temperature else None)
    for _ in range(30):
        logits = rng.normal(0, 2.0, (d + 1, vocab)).astype(np.float32)
        row = SamplingRow(params, np.random.default_rng(int(rng.integers(1 << 30))), [1, 2],
                          [3])
        drafts = [int(np.argmax(logits[j])) if rng.random() < 0.7 else int(rng.integers(vocab))
                  for j in range(d)]
        got = verify(logits, drafts, row)
        assert got.logprobs is not None
        assert len(got.logprobs.token_ids) == len(got.token_ids) == len(got.sampled_logprobs)
        for j, tok in enumerate(got.token_ids):
            lsm = log_softmax(logits[j].astype(np.float64))
            assert got.sampled_logprobs[j] == pytest.approx(lsm[tok], abs=1e-5)
            top = np.argsort(-logits[j], kind="stable")[:num].tolist()
            assert got.logprobs.token_ids[j] == [tok] + top
            np.testing.assert_allclose(got.logprobs.logprobs[j], lsm[[tok] + top], atol=1e-5)
            rank = int(np.count_nonzero(logits[j] > logits[j][tok])) + 1
            assert got.logprobs.ranks[j] == [rank, 1, 2, 3]


def test_lse_from_device_is_the_normaliser() -> None:
    logits = np.random.default_rng(9).normal(0, 1, (3, 20)).astype(np.float32)
    lse = np.array([1.5, -0.5, 2.0], np.float32)
    got = verify(logits, [int(np.argmax(logits[0])), 4],
                 SamplingRow(SamplingParams(temperature=0.0), None), lse=lse)
    for j, tok in enumerate(got.token_ids):
        assert got.sampled_logprobs[j] == pytest.approx(float(logits[j, tok] - lse[j]), abs=1e-6)
