"""Per-request sampling state: what sampling a request's rows needs beyond its parameters (its
generator, EOS ids, penalty statistics, grammar matcher), and how far its prompt logprobs got.
The engine core keeps one per request while the request lives; the host sampler reads them by
request id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxllm.sample.penalties import PenaltyState

if TYPE_CHECKING:
    from jaxllm.engine import EngineCoreRequest
    from jaxllm.structured_output.request import StructuredOutputRequest


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
