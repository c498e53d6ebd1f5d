"""DraftModelProposer: draft tokens from a smaller model of the same vocabulary.

The draft model runs in the engine core beside the target, as its own ModelRunner (its own
compiled buckets and KV array) on the target's paged layout: its KV array has as many blocks
as the target's, and its persistent batch follows every schedule of the target, so a request's
block table is the same for both models. The scheduler keeps `num_speculative_tokens` lookahead
slots past each request's tokens (`SchedulerConfig.num_lookahead_tokens`), where the draft
writes the KV of its own drafts before the target has seen them.

After each step, for the running requests about to decode: one step over the tokens the draft
has not seen yet (the prompt on the first call, then the tokens the target accepted since),
sampling at each request's last token, then k - 1 decode steps, each feeding the previous
draft token. Drafts are greedy (the draft's argmax): a point mass, which the target verifies
like an n-gram draft. The draft's KV of rejected drafts is overwritten by the next catch-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxllm.config import (
    EngineConfig,
    resolve_gemv_max_rows,
    resolve_quantization,
)
from jaxllm.model_executor.model_loader.errors import ModelLoadError
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.worker.model_runner import ModelRunner
from scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.model_executor.model_loader.loader import LoadedModel
    from scheduler import Request


class DraftModelProposer:
    def __init__(self, config: EngineConfig, target: ModelConfig, max_model_len: int,
                 num_blocks: int, target_weights: LoadedModel | None = None) -> None:
        """`target_weights`: the target's loaded weights, shared (not loaded twice) when the
        draft is the target's own checkpoint."""
        spec = config.speculative_config
        assert spec is not None and spec.model is not None  # checked by SpeculativeConfig
        path = Path(spec.model).expanduser()
        quantization = resolve_quantization(None, path, config.dtype, config.kernel_backend,
                                            1, config.platform)
        if target_weights is not None and path.resolve() != target_weights.path.resolve():
            target_weights = None
        if target_weights is not None:
            loaded = target_weights
        else:
            try:
                loaded = load_model(path, dtype=jnp.dtype(config.dtype),
                                    progress=config.show_progress, quantization=quantization,
                                    kernel_backend=config.kernel_backend)
            except ModelLoadError as e:  # the message names the path, not the setting
                raise ModelLoadError(f"speculative_config.model {spec.model!r}: {e}") from e
        draft = loaded.config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                             f"{draft.vocab_size} tokens, the target {target.vocab_size}: a "
                             f"draft model must share the target's vocabulary")
        if draft.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model {spec.model!r} handles "
                             f"{draft.max_position_embeddings} positions, fewer than "
                             f"max_model_len={max_model_len}")
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.runner = ModelRunner(
            draft, loaded.params, dtype=jnp.dtype(config.dtype),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            topk_sampling=config.topk_sampling, gemv_params=loaded.gemv_params,
            gemv_max_rows=resolve_gemv_max_rows(quantization, config.dtype,
                                                config.kernel_backend, config.platform),
            kv_cache_dtype=jnp.dtype(config.kv_cache_dtype),
            activation_dtype=jnp.dtype(config.activation_dtype),
            matmul_precision=config.matmul_precision)
        self.runner.initialize_kv_cache(num_blocks)
        self.compile_time_s = self.runner.compile(progress=config.show_progress)
        # Tokens of each request whose KV the draft holds (a prefix of its tokens).
        self._num_computed: dict[str, int] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the target's schedule: rows, block tables (new, appended, cut, dropped)."""
        self.runner.update_states(scheduler_output)
        for rid in scheduler_output.preempted_req_ids:
            self._num_computed.pop(rid, None)  # its blocks are gone
        for rid in scheduler_output.finished_req_ids:
            self._num_computed.pop(rid, None)

    def remove(self, request_id: str) -> None:
        self._num_computed.pop(request_id, None)

    def propose(self, requests: list[Request]) -> list[list[int]]:
        """Up to k draft tokens for each request (each about to decode: all its tokens but the
        last computed by the target)."""
        k = self.k
        ids = [r.request_id for r in requests]
        # Near max_model_len the lookahead is short: no drafts there.
        active = [i for i, r in enumerate(requests) if r.num_tokens + k <= self.max_model_len]
        drafts: list[list[int]] = [[] for _ in requests]
        if not active:
            return drafts
        last = self._catch_up([requests[i] for i in active])
        tokens = np.asarray(last, np.int64)
        for j, i in enumerate(active):
            drafts[i].append(int(tokens[j]))
        for step in range(1, k):
            scheduled = [ScheduledRequest(ids[i], [drafts[i][-1]],
                                          requests[i].num_tokens + step - 1, [], True, False)
                         for i in active]
            tokens = self._greedy(scheduled)
            for j, i in enumerate(active):
                drafts[i].append(int(tokens[j]))
        return drafts

    def _catch_up(self, requests: list[Request]) -> list[int]:
        """Run the draft over each request's tokens it has not seen, in steps of at most
        max_num_batched_tokens; returns the draft's next token after each request's last."""
        pending = {r.request_id: self._num_computed.get(r.request_id, 0) for r in requests}
        first: dict[str, int] = {}
        while pending:
            budget = self.max_num_batched_tokens
            scheduled = []
            for r in requests:
                start = pending.get(r.request_id)
                if start is None or budget <= 0:
                    continue
                n = min(r.num_tokens - start, budget)
                budget -= n
                done = start + n == r.num_tokens
                scheduled.append(ScheduledRequest(r.request_id, r.all_token_ids[start:start + n],
                                                  start, [], done, False))
            tokens = self._greedy(scheduled)
            j = 0
            for item in scheduled:
                rid = item.request_id
                if item.do_sample:
                    first[rid] = int(tokens[j])
                    j += 1
                    del pending[rid]
                    self._num_computed[rid] = item.seq_len
                else:
                    pending[rid] = item.seq_len
        return [first[r.request_id] for r in requests]

    def _greedy(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """One draft step; the argmax at each sampling request's last token."""
        out = SchedulerOutput(scheduled=scheduled,
                              num_scheduled_tokens={r.request_id: r.num_tokens
                                                    for r in scheduled},
                              total_num_scheduled_tokens=sum(r.num_tokens for r in scheduled))
        result = self.runner.execute_model(out)
        n = sum(r.do_sample for r in scheduled)
        if result.topk is not None:
            tokens = result.topk.token_ids[:n, 0]
        else:
            tokens = np.argmax(result.logits_rows(list(range(n))), axis=1)
        self.runner.release(result)
        return tokens
