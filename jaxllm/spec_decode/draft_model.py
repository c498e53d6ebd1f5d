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
like an n-gram draft. The KV those decode steps wrote for drafts the target accepted is kept;
that of rejected drafts is overwritten by the next proposal.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxllm.config import EngineConfig
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
        # Resolved with the config (EngineArgs.create_engine_config) for method "draft_model".
        assert spec is not None and spec.draft_model_config is not None
        draft_config = spec.draft_model_config
        path = Path(draft_config.model_path)
        if target_weights is not None and path.resolve() != target_weights.path.resolve():
            target_weights = None
        if target_weights is not None:
            loaded = target_weights
        else:
            try:
                loaded = load_model(path, dtype=jnp.dtype(draft_config.dtype),
                                    progress=config.show_progress,
                                    quantization=draft_config.quantization,
                                    kernel_backend=draft_config.kernel_backend,
                                    gguf_layout=draft_config.gguf_layout)
            except ModelLoadError as e:  # the message names the path, not the setting
                raise ModelLoadError(f"speculative_config.model {spec.model!r}: {e}") from e
        draft = loaded.config
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                             f"{draft.vocab_size} tokens, the target {target.vocab_size}: a "
                             f"draft model must share the target's vocabulary")
        if draft.max_context_len < max_model_len:
            raise ValueError(f"speculative_config.model {spec.model!r} handles "
                             f"{draft.max_context_len} positions, fewer than "
                             f"max_model_len={max_model_len}")
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # The draft model runs without the target's LoRA adapters (its weights are another
        # model's): it proposes as the base would, and the target, with the request's
        # adapter, decides every token (its drafts are just accepted less often).
        self.runner = ModelRunner.from_engine_config(
            dataclasses.replace(config, enable_lora=False), loaded, max_model_len,
            gemv_max_rows=draft_config.gemv_max_rows)
        self.runner.initialize_kv_cache(num_blocks)
        self.compile_time_s = self.runner.compile(progress=config.show_progress)
        # Tokens of each request whose KV the draft holds (a prefix of its tokens).
        self._num_computed: dict[str, int] = {}
        # The drafts each request's decode steps fed (their KV is in the draft's array), and
        # the position of the first: those the target accepted need no recomputing.
        self._fed: dict[str, tuple[int, list[int]]] = {}

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Follow the target's schedule: rows, block tables (new, appended, cut, dropped)."""
        self.runner.update_states(scheduler_output)
        for rid in scheduler_output.preempted_req_ids:
            self.remove(rid)  # its blocks are gone
        for rid in scheduler_output.finished_req_ids:
            self.remove(rid)

    def remove(self, request_id: str) -> None:
        self._num_computed.pop(request_id, None)
        self._fed.pop(request_id, None)

    @property
    def tracked_request_ids(self) -> set[str]:
        """The requests the draft model holds KV or pending drafts for: none once every request
        has finished or been aborted (its state would otherwise leak)."""
        return set(self._num_computed) | set(self._fed)

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
                                          requests[i].num_tokens + step - 1, ([],), True,
                                          False)
                         for i in active]
            tokens = self._greedy(scheduled)
            for j, i in enumerate(active):
                drafts[i].append(int(tokens[j]))
        for i in active:
            n = requests[i].num_tokens
            self._fed[ids[i]] = (n, drafts[i][:max(0, min(k - 1, self._covered(ids[i]) - n))])
        return drafts

    def _covered(self, request_id: str) -> int:
        """Positions the request's blocks reach: the draft's KV is real below it. (Its
        lookahead slots are dropped when the KV cache is short; what the draft writes past its
        blocks lands in the reserved null block.) Between a step and the next schedule the
        table may still hold blocks the scheduler just freed with rejected drafts, but those lie
        past the request's tokens and k lookahead slots, which it keeps: beyond every position
        a proposal writes."""
        batch = self.runner.input_batch
        return int(batch.num_blocks[batch.req_id_to_row[request_id]]) * batch.block_size

    def _start(self, request: Request) -> int:
        """The first token the draft has no KV for: past its catch-up, and past the drafts its
        decode steps fed that the target accepted (the same tokens at the same positions)."""
        rid = request.request_id
        start = self._num_computed.get(rid, 0)
        first, fed = self._fed.pop(rid, (-1, []))
        if first == start:
            tokens = request.all_token_ids
            for t in fed:
                if start >= request.num_tokens - 1 or tokens[start] != t:
                    break
                start += 1
        return start

    def _catch_up(self, requests: list[Request]) -> list[int]:
        """Run the draft over each request's tokens it has not seen, in steps of at most
        max_num_batched_tokens; returns the draft's next token after each request's last."""
        pending = {r.request_id: self._start(r) for r in requests}
        first: dict[str, int] = {}
        while pending:
            budget = self.max_num_batched_tokens
            scheduled = []
            for r in requests:
                start = pending.get(r.request_id)
                if start is None or budget <= 0:
                    continue
                # A request about to decode has at least its last token unseen by the draft.
                assert start < r.num_tokens, (r.request_id, start, r.num_tokens)
                n = min(r.num_tokens - start, budget)
                budget -= n
                done = start + n == r.num_tokens
                scheduled.append(ScheduledRequest(r.request_id, r.all_token_ids[start:start + n],
                                                  start, ([],), done, False))
            tokens = self._greedy(scheduled)
            j = 0
            for item in scheduled:
                rid = item.request_id
                if item.do_sample:
                    first[rid] = int(tokens[j])
                    j += 1
                    del pending[rid]
                    self._num_computed[rid] = min(item.seq_len, self._covered(rid))
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
