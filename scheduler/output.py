"""What the scheduler hands the model runner each step, and what it hands back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from scheduler.request import RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions
    `start_position, start_position + 1, ...`.

    The runner keeps each running request's block tables, one per KV cache group (its
    persistent batch): a request scheduled `is_new` brings its whole tables in
    `new_block_ids`; a continuing one only the blocks allocated this step, to append. Slot of
    position p in a group: table[p // block_size] * block_size + p % block_size. Each table
    covers at least `start_position + len(token_ids)` tokens; the KV of positions below
    `start_position` is already in it.
    """

    request_id: str
    token_ids: list[int]
    # The request's num_computed_tokens before this step.
    start_position: int
    new_block_ids: tuple[list[int], ...]  # one list per KV cache group
    # False for a prefill chunk that stops short of the end of the sequence: no token is
    # sampled from it (vLLM V0's do_sample).
    do_sample: bool
    # True when the request comes from the waiting queue this step (first schedule or resumed
    # after preemption): the runner holds no state for it, and new_block_ids is its whole table.
    is_new: bool
    # Opaque Request.sampling_params, so the runner needs nothing but this object.
    sampling_params: Any = None
    # The request's Request.arrival_index: a result applies only to the request it was
    # scheduled for, not to a later one reusing the id (async scheduling applies results a
    # step late).
    arrival_index: int = -1
    # Speculative decoding: the last this many of `token_ids` are draft tokens to verify; the
    # step samples at each of them too, and the result accepts a prefix of them plus one token.
    num_draft_tokens: int = 0
    # The request's LoRA adapter (Request.lora_int_id), read when it `is_new`; 0: none.
    lora_int_id: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens whose KV is in the cache once this step has run (attention's context)."""
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    # Running requests first (in arrival order), then the ones newly taken from the queue.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Draft tokens among them (speculative decoding).
    total_num_draft_tokens: int = 0
    # Lost their blocks this step; the runner drops their state (they come back as is_new).
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished or aborted since the previous schedule(); the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    # Requests whose block table lost its last blocks since the previous schedule() (the
    # blocks of rejected draft tokens went back to the pool): request id -> blocks kept. The
    # runner cuts its tables (every group's) there before appending this step's new blocks.
    truncated_block_tables: dict[str, int] = field(default_factory=dict)
    # Prefix-cache hit tokens of the requests taken from the waiting queue this step.
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # Tokens looked up in the prefix cache this step (the admitted requests' lengths), and how
    # many of them were hits.
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class FinishAfter(NamedTuple):
    """How the engine ends a request in update_from_output, on what the scheduler cannot see
    (a structured-output grammar that is complete or refused a token): its finished status
    and stop reason, after the first `num_tokens` of the tokens sampled for it in that step
    (all of them when None)."""

    status: RequestStatus
    reason: str | None = None
    num_tokens: int | None = None


@dataclass
class RequestResult:
    """One request's result of a step, as plain values: the tokens it accepted and, once it
    ended, why. The engine core turns these into its wire-format outputs."""

    request_id: str
    new_token_ids: list[int]
    # "stop" / "length" / "abort", or None while the request goes on.
    finish_reason: str | None = None
    # The stop token id that finished the request.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Speculative decoding: draft tokens verified this step, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
