"""HostSampler: a step's sampled rows to tokens on the host, for the engine core.

Rows the device's top-K candidates sample exactly (`candidates.exact_rows`) go through the
vectorized candidate sampler, the rest through the full-row sampler (`sampler.sample`) on their
fetched logits. Split in two for async scheduling: `prepare` gathers everything but the
candidates while the step still runs (which rows still have their request, their parameters,
which need logits processing, each random row's draw, and the structured-output masks of the
constrained rows, whose matchers have seen every token applied so far), so that `sample`, inside
the host's critical section between one step's candidates and the next step's dispatch, is
array work.

A constrained row's mask applies before any other processing; its logprobs stay those of the
raw distribution (vLLM's default). It samples from its masked candidates when that is exact
(`candidates.mask_candidates`), else from its full masked row.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.sample.candidates import (
    TopKLogits,
    exact_rows,
    mask_candidates,
    sample_from_topk,
)
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.rejection_sampler import VerifiedTokens, verify
from jaxllm.sample.sampler import SamplingRow, needs_processing, sample
from jaxllm.sample.token_mask import TokenMask, allow_token

if TYPE_CHECKING:
    from jaxllm.engine import SchedulerStats
    from jaxllm.sample.state import SamplingState
    from jaxllm.structured_output.manager import StructuredOutputManager
    from jaxllm.worker.outputs import ModelRunnerOutput, PreparedStep
    from scheduler import Request


@dataclass
class SampleInputs:
    """What sampling a step's rows needs besides the candidates: the rows whose request is still
    here, their parameters, whether each needs logits processing now, and each random row's
    draw."""

    live: np.ndarray  # [n] positions among the step's sampled rows
    requests: list[Request]
    req_ids: list[str]
    metadata: SamplingMetadata
    processed: np.ndarray  # [n] bool
    u: np.ndarray  # [n] float64 (0 for greedy rows)
    # Structured outputs: the constrained rows (positions among the live ones), their masks
    # (one int32 bit row each) and the requests that cannot go on, with why.
    grammar_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    grammar_bitmask: np.ndarray | None = None
    # The constrained rows' masks in the form the full-row sampler applies, by live position:
    # built here when every row goes that way (no device candidates), else at sampling time
    # for the rows that do.
    token_masks: dict[int, TokenMask] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # Each live request's first logits row (its only one without drafts).
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    # Speculative decoding: live positions of the requests verifying drafts, their drafts,
    # and their masks per verified position when constrained.
    spec: np.ndarray = field(default_factory=lambda: np.zeros(0, np.intp))
    drafts: list[list[int]] = field(default_factory=list)
    draft_masks: dict[int, list[TokenMask]] = field(default_factory=dict)

    def take(self, keep: np.ndarray) -> SampleInputs:
        """The inputs of the live positions `keep` only (drafts left out)."""
        pos = np.full(len(self.live), -1, np.intp)
        pos[keep] = np.arange(len(keep))
        g = np.flatnonzero(pos[self.grammar_rows] >= 0)
        req_ids = [self.req_ids[j] for j in keep.tolist()]
        kept_ids = set(req_ids)
        return SampleInputs(
            self.live[keep], [self.requests[j] for j in keep.tolist()], req_ids,
            self.metadata.rows(keep), self.processed[keep], self.u[keep],
            pos[self.grammar_rows[g]],
            None if self.grammar_bitmask is None else self.grammar_bitmask[g],
            {int(pos[j]): m for j, m in self.token_masks.items() if pos[j] >= 0},
            {rid: why for rid, why in self.errors.items() if rid in kept_ids},
            self.rows[keep])

    def positions_of(self, req_ids: list[str]) -> np.ndarray:
        """Each request's position among the live rows, -1 for one no longer here."""
        pos = {rid: j for j, rid in enumerate(self.req_ids)}
        return np.fromiter((pos.get(rid, -1) for rid in req_ids), np.intp, len(req_ids))


@dataclass
class SampledTokens:
    """A step's sampled tokens, per live row: the token, its raw logprob and (when asked) its
    logprob row."""

    req_ids: list[str]
    tokens: np.ndarray  # [n] int64
    logprobs_raw: np.ndarray  # [n] float32
    logprobs: list[LogprobsLists | None]
    # Requests whose constraint allows no next token (their token here is meaningless), and why.
    errors: dict[str, str] = field(default_factory=dict)
    # Requests whose accepted drafts (in `verified`) lead to a position that allows no token:
    # they end with an error after those drafts, and why.
    errors_after_drafts: dict[str, str] = field(default_factory=dict)
    # Speculative decoding, by live position: the verification of the requests with drafts
    # (their accepted drafts and the token after them; `tokens` holds that last token).
    verified: dict[int, VerifiedTokens] = field(default_factory=dict)

    def tokens_for(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at `positions`, 0 where a position is -1 (a request no longer here)."""
        return np.append(self.tokens, 0)[positions]


NOTHING_SAMPLED = SampledTokens([], np.zeros(0, np.int64), np.zeros(0, np.float32), [])


class HostSampler:
    """Samples the rows of the live requests: `requests` maps each request id to the request
    (its parameters, prompt and output tokens; the scheduler's requests), `states` to its
    sampling state (generator, EOS ids, penalty statistics, constraint); `structured_output`
    fills the constrained rows' masks. Both mappings are read at each step, never changed."""

    def __init__(self, requests: Mapping[str, Request], states: Mapping[str, SamplingState],
                 structured_output: StructuredOutputManager | None = None,
                 candidates: bool = True) -> None:
        self.requests = requests
        self.states = states
        self.structured_output = structured_output
        # Whether the device returns top-K candidates; without them every row is sampled from
        # its full logits, so `prepare` readies the constrained rows' masks for that.
        self.candidates = candidates

    def prepare(self, prepared: PreparedStep) -> SampleInputs:
        """The step's sampled rows whose request is still here (with async scheduling a row may
        belong to a request that finished or was aborted, or whose id was reused, since the
        step was scheduled), their parameters from the persistent batch, and their draws."""
        stamp = {r.request_id: r.arrival_index for r in prepared.scheduler_output.scheduled}
        requests = self.requests
        live, reqs = [], []
        for i, rid in enumerate(prepared.inputs.sample_req_ids):
            req = requests.get(rid)
            if req is not None and req.arrival_index == stamp[rid]:
                live.append(i)
                reqs.append(req)
        idx = np.asarray(live, np.intp)
        step_inputs = prepared.inputs
        metadata = step_inputs.sampling
        if len(idx) < len(metadata):
            metadata = metadata.rows(idx)
        processed = np.zeros(len(idx), bool)
        for j in np.flatnonzero(metadata.maybe_processed).tolist():
            processed[j] = needs_processing(self._row(reqs[j]))
        num_verified = step_inputs.num_verified_drafts[idx]
        spec = np.flatnonzero(num_verified > 0)
        u = np.zeros(len(idx))
        states = self.states
        # Exactly one draw per sampled token; requests verifying drafts draw as they verify.
        draws = ~metadata.greedy
        draws[spec] = False
        for j in np.flatnonzero(draws).tolist():
            u[j] = states[reqs[j].request_id].generator.random()
        req_ids = [r.request_id for r in reqs]
        inputs = SampleInputs(idx, reqs, req_ids, metadata, processed, u,
                              rows=step_inputs.sample_rows[idx], spec=spec,
                              drafts=[step_inputs.draft_token_ids[int(i)]
                                      for i in idx[spec].tolist()])
        if self.structured_output is not None:
            is_spec = set(spec.tolist())
            constrained = [(j, so) for j, rid in enumerate(req_ids)
                           if (so := states[rid].structured_output) is not None
                           and not so.is_reasoning and j not in is_spec]
            if constrained:
                inputs.grammar_rows = np.array([j for j, _ in constrained], np.intp)
                inputs.grammar_bitmask, errors = self.structured_output.grammar_bitmask(
                    [so for _, so in constrained])
                for k, (_, so) in enumerate(constrained):
                    if so.reasoning_start_token_id is not None:  # the answer may open a block
                        allow_token(inputs.grammar_bitmask[k], so.reasoning_start_token_id)
                inputs.errors = {req_ids[j]: why for (j, _), why in zip(constrained, errors,
                                                                        strict=True) if why}
                if not self.candidates:
                    vocab = self.structured_output.vocab_size
                    inputs.token_masks = {
                        j: TokenMask.from_bitmask(inputs.grammar_bitmask[k], vocab)
                        for k, (j, _) in enumerate(constrained)}
            for k, j in enumerate(spec.tolist()):
                so = states[req_ids[j]].structured_output
                rows = None if so is None else \
                    self.structured_output.draft_bitmasks(so, inputs.drafts[k])
                if rows is not None:
                    vocab = self.structured_output.vocab_size
                    inputs.draft_masks[j] = [TokenMask.from_bitmask(bits, vocab)
                                             for bits in rows]
        return inputs

    def sample(self, out: ModelRunnerOutput, inputs: SampleInputs,
               stats: SchedulerStats) -> SampledTokens:
        """Sample the live rows: exact rows from the candidates, the others from their full
        logits rows; requests with drafts verify them (`rejection_sampler.verify`)."""
        t0 = time.perf_counter()
        if not inputs.spec.size:
            sampled = self._sample_rows(out, inputs, stats)
        else:
            n = len(inputs.live)
            keep = np.setdiff1d(np.arange(n), inputs.spec)
            part = self._sample_rows(out, inputs.take(keep), stats)
            sampled = SampledTokens(inputs.req_ids, np.zeros(n, np.int64),
                                    np.full(n, np.nan, np.float32), [None] * n,
                                    dict(part.errors))
            sampled.tokens[keep] = part.tokens
            sampled.logprobs_raw[keep] = part.logprobs_raw
            for k, j in enumerate(keep.tolist()):
                sampled.logprobs[j] = part.logprobs[k]
            self._verify(out, inputs, sampled, stats)
        stats.sample_s = time.perf_counter() - t0
        return sampled

    def _verify(self, out: ModelRunnerOutput, inputs: SampleInputs, sampled: SampledTokens,
                stats: SchedulerStats) -> None:
        """Verify the drafts of the requests that brought some, from their full rows."""
        topk = out.topk
        for k, j in enumerate(inputs.spec.tolist()):
            drafts = inputs.drafts[k]
            first = int(inputs.rows[j])
            rows = list(range(first, first + len(drafts) + 1))
            masks = inputs.draft_masks.get(j)
            rid = inputs.req_ids[j]
            if masks is not None and not masks[0].allows_any:
                sampled.errors[rid] = ("the structured-output grammar allows no next token "
                                       "(dead end)")
                continue
            metadata = inputs.metadata
            # `processed` is the first position's; a bad word's prefix may end inside the
            # drafts, so later positions may need processing where the first does not.
            bad_words = inputs.requests[j].sampling_params.bad_words_token_ids
            if topk is not None and metadata.greedy[j] and not inputs.processed[j] \
                    and not bad_words and masks is None and metadata.num_logprobs[j] < 0:
                # Greedy rows without processing: the device's top candidate is each row's
                # argmax, no full row is fetched.
                result = self._verify_greedy_candidates(topk, rows, drafts,
                                                        metadata.rows(np.full(len(rows), j)))
            else:
                result = verify(out.logits_rows(rows), drafts, self._row(inputs.requests[j]),
                                masks=masks, lse=None if topk is None else topk.lse[rows],
                                all_sampled_logprobs=False)
                stats.num_full_row_samples += len(rows)
            if result.error is not None:
                if not result.token_ids:
                    sampled.errors[rid] = result.error
                    continue
                sampled.errors_after_drafts[rid] = result.error
            sampled.verified[j] = result
            sampled.tokens[j] = result.token_ids[-1]
            sampled.logprobs_raw[j] = result.sampled_logprobs[-1]

    @staticmethod
    def _verify_greedy_candidates(topk: TopKLogits, rows: list[int], drafts: list[int],
                                  metadata: SamplingMetadata) -> VerifiedTokens:
        tokens, logprobs, _ = sample_from_topk(topk.rows(np.asarray(rows)), metadata,
                                               np.zeros(len(rows)))
        n = 1
        while n <= len(drafts) and int(tokens[n - 1]) == drafts[n - 1]:
            n += 1
        return VerifiedTokens([int(t) for t in tokens[:n]], [float(x) for x in logprobs[:n]],
                              None, n - 1)

    def _sample_rows(self, out: ModelRunnerOutput, inputs: SampleInputs,
                     stats: SchedulerStats) -> SampledTokens:
        """Sample the live rows without drafts."""
        n = len(inputs.live)
        tokens = np.empty(n, np.int64)
        sampled_logprobs = np.full(n, np.nan, np.float32)
        logprobs: list[LogprobsLists | None] = [None] * n
        metadata, topk = inputs.metadata, out.topk
        errors = dict(inputs.errors)
        grammar_rows, bitmask = inputs.grammar_rows, inputs.grammar_bitmask
        masked = None
        if topk is not None:
            if n < len(topk.lse):  # some requests gone, or rows of drafts in between
                topk = topk.rows(inputs.rows)
            if bitmask is not None:
                masked = mask_candidates(topk, grammar_rows, bitmask)
            exact = exact_rows(metadata, inputs.processed, topk, masked)
        else:
            exact = np.zeros(n, bool)
        fast = np.flatnonzero(exact)
        if fast.size:
            assert topk is not None  # rows are exact only with candidates
            every = fast.size == n
            fast_tokens, fast_logprobs, fast_logprob_rows = sample_from_topk(
                topk if every else topk.rows(fast),
                metadata if every else metadata.rows(fast), inputs.u[fast],
                None if masked is None else masked if every else masked.rows(fast))
            tokens[fast], sampled_logprobs[fast] = fast_tokens, fast_logprobs
            for j in np.flatnonzero(metadata.num_logprobs[fast] >= 0).tolist():
                logprobs[int(fast[j])] = fast_logprob_rows[j]
        full = np.flatnonzero(~exact)
        if full.size:
            full_rows = [self._row(inputs.requests[i], self._mask(inputs, i))
                         for i in full.tolist()]
            logits = out.logits_rows(inputs.rows[full].tolist())
            if topk is not None:
                result = sample(logits, full_rows, lse=topk.lse[full], u=inputs.u[full])
            else:  # the raw log-normaliser costs a pass over the vocabulary: only when asked
                result = sample(logits, full_rows, u=inputs.u[full], all_sampled_logprobs=any(
                    r.params.logprobs is not None for r in full_rows))
            tokens[full], sampled_logprobs[full] = result.token_ids, result.sampled_logprobs
            for j, i in enumerate(full.tolist()):
                logprobs[i] = result.logprobs[j]
            for j, why in result.errors.items():
                errors.setdefault(inputs.req_ids[int(full[j])], why)
        stats.num_full_row_samples = int(full.size)
        return SampledTokens(inputs.req_ids, tokens, sampled_logprobs, logprobs, errors)

    def _mask(self, inputs: SampleInputs, j: int) -> TokenMask | None:
        """The mask of live row j for the full-row sampler; None for an unconstrained row."""
        mask = inputs.token_masks.get(j)
        if mask is None and inputs.grammar_bitmask is not None:
            k = np.flatnonzero(inputs.grammar_rows == j)
            if k.size:
                assert self.structured_output is not None  # it filled the bitmask
                mask = TokenMask.from_bitmask(inputs.grammar_bitmask[int(k[0])],
                                              self.structured_output.vocab_size)
        return mask

    def _row(self, req: Request, mask: TokenMask | None = None) -> SamplingRow:
        state = self.states[req.request_id]
        return SamplingRow(params=req.sampling_params, generator=state.generator,
                           prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids,
                           eos_token_ids=state.eos_token_ids, penalties=state.penalties,
                           mask=mask)
