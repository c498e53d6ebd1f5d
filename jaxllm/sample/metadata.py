"""SamplingMetadata: the sampled rows' parameters as arrays (vLLM's name), so the candidate
sampler and its exactness check run as numpy over rows instead of Python over requests.

The persistent input batch keeps one entry per running request (`RowSamplingParams`, written
when the request gets its row) and gathers a step's sampled rows into one of these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from jaxllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: np.ndarray  # [R] float64
    top_k: np.ndarray  # [R] int64, -1 for none
    top_p: np.ndarray  # [R] float64
    min_p: np.ndarray  # [R] float64, 0 for none
    # math.log(min_p) (0 where min_p is 0), computed once per request with the same log the
    # scalar path uses, so vectorized thresholds equal `candidates.min_p_threshold` bit for bit.
    log_min_p: np.ndarray  # [R] float64
    num_logprobs: np.ndarray  # [R] int64, -1 for none
    greedy: np.ndarray  # [R] bool
    # The request has allowed_token_ids, bad words, bias, penalties or min_tokens: its row may
    # need logits processing.
    maybe_processed: np.ndarray  # [R] bool

    def __len__(self) -> int:
        return len(self.temperature)

    def rows(self, index: np.ndarray) -> SamplingMetadata:
        return SamplingMetadata(*(getattr(self, f.name)[index] for f in fields(self)))

    @classmethod
    def empty(cls, num_rows: int) -> SamplingMetadata:
        """Preallocated rows holding greedy defaults."""
        return cls(np.zeros(num_rows), np.full(num_rows, -1, np.int64), np.ones(num_rows),
                   np.zeros(num_rows), np.zeros(num_rows), np.full(num_rows, -1, np.int64),
                   np.ones(num_rows, bool), np.zeros(num_rows, bool))

    def set_row(self, row: int, params: SamplingParams | None) -> None:
        if params is None:
            params = SamplingParams(temperature=0.0)
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.log_min_p[row] = math.log(params.min_p) if params.min_p > 0.0 else 0.0
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.greedy[row] = params.greedy
        self.maybe_processed[row] = bool(
            params.allowed_token_ids or params.bad_words_token_ids or params.logit_bias
            or params.min_tokens or params.repetition_penalty != 1.0
            or params.frequency_penalty or params.presence_penalty)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> SamplingMetadata:
        metadata = cls.empty(len(params))
        for i, row_params in enumerate(params):
            metadata.set_row(i, row_params)
        return metadata

    def min_p_thresholds(self, zmax: np.ndarray) -> np.ndarray:
        """float32 logit threshold of min_p per row (-inf where there is none), as
        `candidates.min_p_threshold` computes it one row at a time."""
        thr = (zmax.astype(np.float64) + self.temperature * self.log_min_p).astype(np.float32)
        return np.where(self.min_p > 0.0, thr, np.float32(-np.inf))
