"""Per-request sampling state: what sampling a request's rows needs beyond its parameters (its
generator, EOS ids, penalty statistics, grammar matcher), and how far its prompt logprobs got.
The engine core keeps one per request in `SamplingStates` while the request lives; the host
sampler reads them by request id."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.penalties import PenaltyState

if TYPE_CHECKING:
    from jaxllm.engine import EngineCoreRequest
    from jaxllm.structured_output.request import StructuredOutputRequest
    from jaxllm.worker.outputs import PromptLogprobRows
    from scheduler import ScheduledRequest


@dataclass
class SamplingState:
    """One request's sampling state."""

    request: EngineCoreRequest
    generator: np.random.Generator
    eos_token_ids: frozenset[int]
    # Token statistics of a request that uses penalties, updated by each new token.
    penalties: PenaltyState | None = None
    # Next prompt position whose logprob entry is still owed when prompt logprobs are asked
    # (survives preemption, so a recomputed prompt does not emit its entries twice).
    prompt_logprobs_next: int | None = None
    # Structured outputs: the request's grammar and matcher.
    structured_output: StructuredOutputRequest | None = None

    @classmethod
    def from_request(cls, req: EngineCoreRequest) -> SamplingState:
        """The state of a new request; ValueError for a seed numpy refuses."""
        params = req.sampling_params
        try:
            generator = np.random.default_rng(req.seed)
        except (ValueError, TypeError) as e:
            raise ValueError(f"request {req.request_id!r}: bad seed {req.seed!r}: {e}") from e
        state = cls(req, generator, frozenset(req.eos_token_ids))
        if params.repetition_penalty != 1.0 or params.frequency_penalty \
                or params.presence_penalty:
            state.penalties = PenaltyState(req.prompt_token_ids)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs_next = 0
        return state


class SamplingStates(Mapping[str, SamplingState]):
    """The live requests' sampling states by request id, with how many use penalties, owe
    prompt logprobs or are constrained: most steps have none of them and skip that work."""

    def __init__(self) -> None:
        self._states: dict[str, SamplingState] = {}
        self.num_penalized = 0
        self.num_prompt_logprobs = 0
        self.num_constrained = 0

    def __getitem__(self, request_id: str) -> SamplingState:
        return self._states[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def add(self, state: SamplingState) -> None:
        """Keep a new request's state (replacing any left under its id). Its counts (penalized,
        constrained) are taken now: the state's penalties and matcher are set before it is
        added and not changed after."""
        self.remove(state.request.request_id)
        self._states[state.request.request_id] = state
        self._count(state, 1)

    def remove(self, request_id: str) -> None:
        """Drop a finished or aborted request's state (unknown ids are ignored)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self._count(state, -1)

    def append_output_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        """New tokens of a request: its penalty statistics follow them."""
        state = self._states.get(request_id)
        if state is not None and state.penalties is not None:
            for token in token_ids:
                state.penalties.append(token)

    def prompt_logprob_positions(self, scheduled: Iterable[ScheduledRequest]
                                 ) -> dict[str, tuple[int, list[int]]]:
        """For a step's scheduled requests: request id -> (first prompt position of the step
        whose logprob entry is still owed, relative to the request's start in the step; the
        next prompt token of each owed position). Position p predicts token p + 1: entries for
        p < num_prompt - 1. Positions emitted before a preemption are not owed again."""
        if not self.num_prompt_logprobs:
            return {}
        want = {}
        for r in scheduled:
            state = self._states.get(r.request_id)
            if state is None or state.prompt_logprobs_next is None:
                continue
            prompt = state.request.prompt_token_ids
            first = max(r.start_position, state.prompt_logprobs_next)
            end = min(r.seq_len, len(prompt) - 1)
            if end > first:
                want[r.request_id] = (first - r.start_position, list(prompt[first + 1:end + 1]))
        return want

    def prompt_logprobs(self, request_id: str, stats: PromptLogprobRows) -> LogprobsLists | None:
        """The prompt logprob entries of the positions `stats` covers (each: the prompt's next
        token, then the top ones), which are then no longer owed; None for a request no longer
        here."""
        state = self._states.get(request_id)
        if state is None:
            return None
        req = state.request
        num = req.sampling_params.prompt_logprobs
        assert num is not None  # only requests that asked for prompt logprobs get rows
        rows = LogprobsLists([], [], [])
        targets = req.prompt_token_ids[stats.first_position + 1:]
        for i in range(len(stats.lse)):
            lse = float(stats.lse[i])
            rows.token_ids.append([int(targets[i])] + stats.token_ids[i, :num].tolist())
            rows.logprobs.append([float(stats.target_logit[i]) - lse]
                                 + [v - lse for v in stats.values[i, :num].tolist()])
            rows.ranks.append([int(stats.target_rank[i])] + list(range(1, num + 1)))
        state.prompt_logprobs_next = stats.first_position + len(stats.lse)
        return rows

    def _count(self, state: SamplingState, delta: int) -> None:
        self.num_penalized += delta * (state.penalties is not None)
        self.num_prompt_logprobs += delta * (state.prompt_logprobs_next is not None)
        self.num_constrained += delta * (state.structured_output is not None)
