"""The pooling runner's pooler (vLLM's model_executor/layers/pooler.py), on the host: a prompt's
final-normed hidden states (what every step returns for each of its rows) -> one vector.

A prompt may be prefilled over several steps (chunked prefill): LAST reads the row of the
chunk that ends the prompt, CLS the row of position 0, and MEAN keeps a running float64 sum
over the chunks. A prefix-cache hit skips the rows of the cached positions, so only LAST
requests use the prefix cache (the engine core makes MEAN and CLS requests skip it). A chunk
that starts again at position 0 (a preempted request recomputed) starts the sum again; a chunk
that does not continue the sum (of a step scheduled before the preemption) is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxllm.config import PoolerConfig
from jaxllm.pooling_params import PoolingParams
from scheduler import ScheduledRequest


@dataclass
class _MeanState:
    total: np.ndarray  # float64 sum of the rows so far (empty before the first)
    next_position: int  # the position the next chunk must start at


def embedding_head(pooled: np.ndarray, params: PoolingParams, config: PoolerConfig
                   ) -> np.ndarray:
    """vLLM's embedding head: the first `dimensions` values (Matryoshka), then L2-normalized
    unless the request or the pooler config says not to; float32."""
    vec = np.asarray(pooled, np.float64)
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    if normalize:
        # As torch.nn.functional.normalize: a zero vector stays zero.
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype(np.float32)


class Pooler:
    """Pools each pooling request's prompt rows as its chunks come out of the steps."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._means: dict[str, _MeanState] = {}  # MEAN: the sum so far
        self._first: dict[str, np.ndarray] = {}  # CLS: the first row, until the prompt ends

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether a request may skip computing its cached prefix (only the last row counts)."""
        return self.config.pooling_type == "LAST"

    def pool_step(self, scheduled: list[ScheduledRequest], num_prompt_tokens: dict[str, int],
                  hidden_rows: Callable[[], np.ndarray]) -> dict[str, np.ndarray]:
        """One step's pooling requests (`num_prompt_tokens`: request id -> prompt length, for
        the scheduled requests that pool) -> the raw pooled vector of each whose prompt this
        step completes. `hidden_rows()`: the step's hidden states [T, hidden] on the host,
        fetched only when some request here needs a row."""
        kind = self.config.pooling_type
        fetched: list[np.ndarray] = []

        def rows(begin: int, end: int) -> np.ndarray:
            if not fetched:
                fetched.append(hidden_rows())
            return fetched[0][begin:end].astype(np.float64)

        done: dict[str, np.ndarray] = {}
        offset = 0
        for r in scheduled:
            rid, start, n = r.request_id, r.start_position, r.num_tokens
            begin, offset = offset, offset + n
            total = num_prompt_tokens.get(rid)
            if total is None:
                continue
            completes = start + n >= total
            if kind == "LAST":
                if completes:
                    done[rid] = rows(begin + n - 1, begin + n)[0]
                continue
            if kind == "CLS":
                if start == 0:
                    self._first[rid] = rows(begin, begin + 1)[0]
                if completes and rid in self._first:
                    done[rid] = self._first.pop(rid)
                continue
            state = self._means.get(rid)
            if start == 0:
                state = self._means[rid] = _MeanState(np.zeros(0), 0)
            elif state is None or state.next_position != start:
                continue  # a stale chunk of a request that has started over
            part = rows(begin, begin + n).sum(axis=0)
            state.total = part if state.next_position == 0 else state.total + part
            state.next_position = start + n
            if completes:
                del self._means[rid]
                done[rid] = state.total / total
        return done

    def remove(self, request_id: str) -> None:
        """Forget a request's running state (finished or aborted)."""
        self._means.pop(request_id, None)
        self._first.pop(request_id, None)
