"""What a ModelRunner step hands back (vLLM's v1/outputs.py): the prepared host inputs, the
dispatched step's device outputs, and the sampled rows' candidates on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxllm.sample.candidates import TopKLogits
from jaxllm.worker.input_batch import StepInputs
from scheduler import SchedulerOutput


@dataclass
class StepTimings:
    prepare_s: float = 0.0
    device_s: float = 0.0  # dispatch to the small outputs being on the host
    transfer_s: float = 0.0


@dataclass
class PreparedStep:
    """A step's host inputs, built from its SchedulerOutput while the previous step may still
    run. Tokens the previous step has yet to sample are placeholders (-1) in `input_ids`, one
    per listed request, filled by `ModelRunner.dispatch`."""

    scheduler_output: SchedulerOutput
    inputs: StepInputs
    shape: tuple[int, int]  # (num_tokens, max_query_len) of the compiled step
    placeholder_index: np.ndarray  # [P] flat token index of each placeholder
    placeholder_req_ids: list[str]
    prepare_s: float


@dataclass
class StepHandle:
    """A dispatched step: its outputs are device arrays until `ModelRunner.wait`."""

    prepared: PreparedStep
    values: jax.Array | None  # [S, K] top-K logits per sampled row (None: top-K off)
    token_ids: jax.Array | None  # [S, K]
    lse: jax.Array | None  # [S]
    logits: jax.Array  # [S, vocab], stays on the device unless a row needs it
    hidden: jax.Array  # [T, hidden], for prompt logprobs
    dispatch_time: float  # perf_counter just before the executable was called
    launched_time: float  # ... and once the call returned (the launch cost is host time too)
    launch_index: int = 0  # the runner's launch count after this step (several hosts)


@dataclass
class PromptLogprobRows:
    """Raw-distribution statistics of n consecutive prompt positions from `first_position`,
    each scoring the prompt's next token: its logit and rank, the top values and ids (sorted by
    value, then id) and the row's log-sum-exp."""

    first_position: int
    target_logit: np.ndarray  # [n] float32
    target_rank: np.ndarray  # [n] int32: 1 + tokens with a larger logit
    values: np.ndarray  # [n, MAX_LOGPROBS] float32
    token_ids: np.ndarray  # [n, MAX_LOGPROBS] int32
    lse: np.ndarray  # [n] float32


@dataclass
class ModelRunnerOutput:
    """The sampled rows' top-K candidates on the host; full logits rows and prompt-logprob
    logits on request (`logits_rows`); prompt logprob statistics where asked."""

    sample_req_ids: list[str]
    # Rows follow the step's logits rows (one per sampling request, 1 + d for one verifying d
    # drafts; `StepInputs.sample_rows`); None when the runner has top-K off.
    topk: TopKLogits | None
    handle: StepHandle
    # When the small outputs were on the host (perf_counter): the start of the host's critical
    # section, which ends when the next step is dispatched.
    ready_time: float = 0.0
    timings: StepTimings = field(default_factory=StepTimings)
    step_shape: tuple[int, int] = (0, 0)  # (num_tokens, max_query_len) of the compiled step
    # Precompiled one-row fetch for this step's logits shape; None on CPU.
    row_slice: Any = None
    # request id -> the prompt positions it wants logprobs for, computed on the device
    prompt_logprobs: dict[str, PromptLogprobRows] = field(default_factory=dict)
    # Several hosts: (handle, rows) -> those rows' full logits, gathered from every process.
    fetch_rows: Any = None

    def logits_rows(self, rows: Sequence[int]) -> np.ndarray:
        """Full logits [len(rows), vocab] of the given sampled rows; valid until the runner's
        `release` of this output (the buffer then serves a later step)."""
        logits = self.handle.logits
        if self.fetch_rows is not None:  # several hosts: a collective gather of the rows
            return self.fetch_rows(self.handle, list(rows))
        if self.row_slice is None:  # CPU: host memory already; rows 0..n-1 need no copy
            host = np.asarray(logits)
            rows = list(rows)
            return host[:len(rows)] if rows == list(range(len(rows))) else host[rows]
        return np.stack([np.asarray(self.row_slice(logits, np.int32(r))) for r in rows])


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated output on the host (several hosts: from this process's own copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def row_slice(logits: jax.Array, row: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(logits, row, keepdims=False)


def take_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    return jax.numpy.take(logits, rows, axis=0)
