"""One generation request as the scheduler sees it: token ids, progress and stop parameters."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    # Back in the waiting queue after its blocks were taken; recomputed when rescheduled.
    PREEMPTED = enum.auto()
    # Everything after this point is finished; `is_finished` relies on the ordering.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # The request cannot go on (e.g. its output constraint reached a dead end); `stop_reason`
    # says why.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# The strings the OpenAI-style API reports (vLLM's `finish_reason`).
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """A request and its progress.

    Only the stop-relevant sampling parameters live here; how tokens are sampled (and stop
    strings, which need text) is decided elsewhere. `sampling_params` is an opaque payload the
    scheduler never reads but hands to the model runner with every scheduled step.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_id: int | None = None
    stop_token_ids: Sequence[int] = ()
    sampling_params: Any = None
    # Compute every prompt token even if cached (prompt logprobs need each position's logits).
    skip_prefix_cache: bool = False
    # An embedding request: its prompt is computed (in chunks) and nothing is sampled; it
    # finishes "stop" with the step that computes its last prompt token.
    pooling: bool = False
    # The LoRA adapter it runs with (0: none): its KV differs from the base model's, so the
    # prefix cache keys its blocks on it, and the scheduler counts it against max_loras.
    lora_int_id: int = 0

    output_token_ids: list[int] = field(default_factory=list, init=False)
    # Prompt followed by outputs, kept as one list so a recompute after preemption and the
    # block hashes can slice it without concatenating.
    all_token_ids: list[int] = field(init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    # Set by Scheduler.add_request; FCFS order and the preemption victim both follow it.
    arrival_index: int = field(default=0, init=False)
    # Tokens whose KV is in the cache (the last token of a running request is not, until the
    # step that samples its successor computes it).
    num_computed_tokens: int = field(default=0, init=False)
    # Prefix-cache hit tokens at the first schedule (not updated by later recomputes).
    num_cached_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    # Async scheduling: tokens of scheduled steps whose results are not applied yet, and how
    # many of those steps sample a token for this request (its next tokens, unknown so far).
    num_inflight_tokens: int = field(default=0, init=False)
    num_output_placeholders: int = field(default=0, init=False)
    # The stop token id that finished the request, a stop string set by the output side, or
    # why it ended with an error.
    stop_reason: int | str | None = field(default=None, init=False)
    # Speculative decoding: draft tokens proposed for the step after the next scheduled one;
    # the scheduler puts them after the request's next token and clears them.
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    # Hash of each full block of `all_token_ids`, chained; filled lazily by KVCacheManager.
    block_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"request {self.request_id!r}: min_tokens must be in [0, max_tokens], "
                f"got {self.min_tokens} with max_tokens={self.max_tokens}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
