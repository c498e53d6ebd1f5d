"""Continuous batching: one token budget per step, chunked prefill, preemption by recompute."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.kv_cache_manager import KVCacheManager, prompt_blocks_needed
from scheduler.output import FinishAfter, RequestResult, ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # The one token budget of a step, shared by decodes, prefill chunks and new prompts.
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    # Including the reserved null block 0; usable blocks are num_blocks - 1.
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    # Speculative decoding with a draft model: slots a request keeps past its scheduled tokens,
    # where the draft model writes the KV of its drafts before the target sees them.
    num_lookahead_tokens: int = 0
    # Each KV cache group's attention window, None for full attention
    # (KVCacheManager's group_windows): in a sliding group a request's blocks wholly before its
    # next query's window are freed as it advances.
    kv_group_windows: tuple[int | None, ...] = (None,)
    # LoRA: most distinct adapters among the running requests (0: no LoRA).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}"
            )
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0 (0: no LoRA), got {self.max_loras}")


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status if its last output token ends it.

    A stop token wins over a length limit reached by the same token, so a model that ends with
    EOS on its last allowed token reports "stop". Stop strings are checked on text elsewhere.
    """
    if request.num_output_tokens >= request.min_tokens:
        last = request.output_token_ids[-1]
        if not request.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


class Scheduler:
    """Decides which tokens of which requests the next step computes.

    Call schedule() and update_from_output() alternately, the latter even for an empty step:
    num_computed_tokens advances only there, and requests finished inside schedule() report
    through it. Async scheduling calls schedule() once more before applying the previous
    step's output: a request that step samples for counts one placeholder token (unknown id,
    -1 in `token_ids`) and computes it next, unless that token certainly ends it (max_tokens,
    max_model_len). One ending by a stop token is in the next step anyway; its result there
    is dropped, since it is gone by then.

    Invariant the preemption choice rests on: `running` is in arrival order and every running
    request arrived before every waiting one (the waiting queue is FCFS and never skipped;
    a preempted request, the latest running one, goes back to its front). So running[-1] is
    the latest arrival, and never one already scheduled earlier in the same step. The one
    exception is LoRA's: while the queue's head waits for a free adapter slot (max_loras),
    requests that need none are started past it; running[-1] is then the latest started, and
    still never one scheduled earlier in the step (the running loop goes front to back).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching,
            config.kv_group_windows,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished since the last schedule(); reported in its output so the runner drops them.
        self.finished_req_ids: list[str] = []
        # Outputs of requests finished inside schedule(), returned by the next update.
        self._pending_outputs: list[RequestResult] = []
        self._next_arrival_index = 0
        self.num_preemptions = 0
        # Speculative decoding since start: steps that verified a request's drafts, the drafts
        # verified and those accepted.
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        # Block tables cut since the last schedule(), reported in its output (see
        # SchedulerOutput.truncated_block_tables).
        self._truncated: dict[str, int] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError for one that could never be scheduled."""
        self.check_request(request)
        request.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """What add_request checks, without queueing: ValueError for a request that could
        never be scheduled (for callers that hold a request back before queueing it)."""
        cfg = self.config
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {rid!r} was already used")
        if request.num_prompt_tokens > cfg.max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens exceeds "
                f"max_model_len={cfg.max_model_len}"
            )
        need = prompt_blocks_needed(request.num_prompt_tokens, cfg.block_size,
                                    cfg.kv_group_windows, cfg.max_num_batched_tokens)
        have = self.num_usable_blocks
        if need > have:
            raise ValueError(
                f"request {rid!r}: prompt of {request.num_prompt_tokens} tokens needs {need} "
                f"KV blocks of {cfg.block_size} tokens, the cache has only {have}"
            )

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string found); unknown ids are ignored,
        since a request may have finished on its own in the meantime."""
        if not status.is_finished:
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
        """Speculative decoding: each request's draft tokens for its next step (replacing any
        it had); ids of requests no longer here are ignored. schedule() decides how many of
        them the step verifies."""
        for rid, drafts in draft_token_ids.items():
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                request.spec_token_ids = [int(t) for t in drafts]

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    @property
    def usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        """KV blocks no request holds (free prefix-cached blocks count as free)."""
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """KV blocks requests can hold: all but the reserved null block."""
        return self.kv_cache_manager.num_usable_blocks

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.running), len(self.waiting)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        # Recompute rather than swap: the blocks go back to the pool (full ones stay cached, so
        # the recompute may hit them) and the request starts over at the front of the queue.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # In-flight KV is lost with the blocks; a token in flight still arrives and is kept.
        request.num_inflight_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish_unfittable(self, request: Request) -> None:
        # Called when the request holds the only blocks in use and still cannot grow: the KV
        # cache is its real length limit, so it ends like a max_model_len cap instead of
        # waiting forever.
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self._free_request(request)
        self._pending_outputs.append(
            RequestResult(
                request.request_id, [], request.finish_reason, None, request.num_cached_tokens
            )
        )

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens

        # Running requests first, in arrival order: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_output_placeholders
            if pending and (request.num_output_tokens + pending >= request.max_tokens
                            or request.num_tokens + pending >= cfg.max_model_len):
                i += 1  # its in-flight token is its last
                continue
            num_new = min(request.num_tokens + pending - request.num_computed_tokens
                          - request.num_inflight_tokens, budget)
            if num_new <= 0:
                i += 1  # a pooling request whose last prompt chunk is in flight
                continue
            drafts: list[int] = []
            if request.spec_token_ids:
                drafts = self._take_drafts(request, num_new, pending, budget)
                num_new += len(drafts)
            scheduled = True
            lookahead = self._lookahead(request, num_new)
            while (new_blocks := kv.allocate_slots(request, num_new, (), lookahead)) is None:
                if lookahead or drafts:  # never worth a preemption: without them first
                    num_new -= len(drafts)
                    drafts, lookahead = [], 0
                    continue
                if len(self.running) == 1:
                    if kv.frees_behind_windows and request.num_inflight_tokens:
                        # The step in flight frees the blocks behind its window when it
                        # lands: wait for it rather than end the request.
                        scheduled = False
                        break
                    self.running.pop()
                    self._finish_unfittable(request)
                    scheduled = False
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    scheduled = False
                    break
            if not scheduled:
                break
            assert new_blocks is not None  # the loop above exits with blocks or unscheduled
            self._add_to_output(out, request, num_new,
                                tuple([b.block_id for b in blocks] for blocks in new_blocks),
                                is_new=False, drafts=drafts)
            budget -= num_new
            i += 1

        # Then the waiting queue, FCFS. Not after a preemption: the victim now heads the queue
        # and would only take back, at once, the blocks it just lost.
        while (
            not out.preempted_req_ids
            and self.waiting
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            request = self.waiting[0]
            if self._lora_full(request):
                # It waits for a running adapter's requests to finish; requests that need no
                # adapter slot (none, or one running) go ahead of it meanwhile, vLLM's rule.
                running = self._running_loras()
                request = next((r for r in self.waiting
                                if not r.lora_int_id or r.lora_int_id in running), None)
                if request is None:
                    break
            computed_blocks, num_hit = kv.get_computed_blocks(request)
            if self.running and request.status == RequestStatus.PREEMPTED \
                    and kv.num_free_blocks_to_hold(request, computed_blocks,
                                                   cfg.max_num_batched_tokens) \
                    > kv.num_free_blocks:
                # A preempted request comes back only when its whole sequence so far fits: if
                # only its first chunk did, the pool that just ran out would run out again
                # before it caught up, and it (the latest running) would be preempted again,
                # its progress lost. The queue waits with it (first come, first served).
                break
            num_new = min(request.num_tokens - num_hit, budget)
            if kv.allocate_slots(request, num_new, computed_blocks,
                                 self._lookahead(request, num_new, num_hit)) is None \
                    and kv.allocate_slots(request, num_new, computed_blocks) is None:
                if self.running:
                    break
                self.waiting.remove(request)
                self._finish_unfittable(request)
                continue
            self.waiting.remove(request)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            out.num_cached_tokens[request.request_id] = num_hit
            if kv.enable_caching and not request.skip_prefix_cache:
                out.num_prefix_cache_queries += request.num_tokens
                out.num_prefix_cache_hits += num_hit
            self._add_to_output(out, request, num_new, kv.get_block_ids(request.request_id),
                                is_new=True)
            budget -= num_new

        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        out.truncated_block_tables, self._truncated = self._truncated, {}
        return out

    def _lora_full(self, request: Request) -> bool:
        """Whether starting `request` would run more than max_loras adapters at once."""
        lora = request.lora_int_id
        if not lora or not self.config.max_loras:
            return False
        running = self._running_loras()
        return lora not in running and len(running) >= self.config.max_loras

    def _running_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.running} - {0}

    def _lookahead(self, request: Request, num_new: int, num_computed: int | None = None) -> int:
        """Lookahead slots for the request after `num_new` more tokens, within max_model_len."""
        if not self.config.num_lookahead_tokens:
            return 0
        if num_computed is None:
            num_computed = request.num_computed_tokens + request.num_inflight_tokens
        return max(0, min(self.config.num_lookahead_tokens,
                          self.config.max_model_len - num_computed - num_new))

    def _take_drafts(self, request: Request, num_new: int, pending: int,
                     budget: int) -> list[int]:
        """The request's draft tokens that go into this step (clearing them all): only
        after a decode token (no placeholder, nothing else in flight), within the budget, and
        never more than its remaining tokens can use (accepted drafts and the one token after
        them must fit max_tokens and max_model_len)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if num_new != 1 or pending or request.num_inflight_tokens:
            return []
        return drafts[:max(0, min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                                  self.config.max_model_len - request.num_tokens - 1))]

    def _add_to_output(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        new_block_ids: tuple[list[int], ...],
        is_new: bool,
        drafts: Sequence[int] = (),
    ) -> None:
        start = request.num_computed_tokens + request.num_inflight_tokens
        rid = request.request_id
        num_draft = len(drafts)
        if num_draft:  # the request's last token, then its drafts
            token_ids = request.all_token_ids[start:] + list(drafts)
        else:
            token_ids = request.all_token_ids[start : start + num_new]
        if len(token_ids) < num_new:  # placeholders for tokens still being sampled
            token_ids += [-1] * (num_new - len(token_ids))
        do_sample = not request.pooling and (start + num_new - num_draft
                                             == request.num_tokens
                                             + request.num_output_placeholders)
        out.scheduled.append(
            ScheduledRequest(
                request_id=rid,
                token_ids=token_ids,
                start_position=start,
                new_block_ids=new_block_ids,
                do_sample=do_sample,
                is_new=is_new,
                sampling_params=request.sampling_params,
                arrival_index=request.arrival_index,
                num_draft_tokens=num_draft,
                lora_int_id=request.lora_int_id,
            )
        )
        request.num_inflight_tokens += num_new
        request.num_output_placeholders += do_sample
        out.num_scheduled_tokens[rid] = num_new
        out.total_num_scheduled_tokens += num_new
        out.total_num_draft_tokens += num_draft

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled_token_ids: Mapping[str, Sequence[int]],
        finish_after: Mapping[str, FinishAfter] | None = None,
    ) -> list[RequestResult]:
        """Apply a step's results: tokens computed, tokens sampled, stops, freed blocks.

        `sampled_token_ids` maps every request scheduled with do_sample to the token(s)
        sampled for it: one, or with draft tokens the accepted drafts and one more; they are
        accepted one by one until a stop (tokens past it are dropped). The KV of rejected
        drafts does not count as computed, and blocks only they used are freed.

        `finish_after` maps requests that end once their tokens here (or the first
        `FinishAfter.num_tokens` of them) are appended to their finished status and stop reason
        (the engine's decision on what the scheduler cannot see, e.g. a structured-output
        grammar that is complete or refused a token); a stop among those tokens ends the
        request first, with its own reason. Drafts count as accepted as verified, wherever
        either cuts them.
        """
        kv = self.kv_cache_manager
        outputs, self._pending_outputs = self._pending_outputs, []
        for item in scheduler_output.scheduled:
            rid = item.request_id
            request = self.requests.get(rid)
            if request is None or request.arrival_index != item.arrival_index:
                continue  # finished (aborted, stopped) between schedule() and now
            running = request.status == RequestStatus.RUNNING
            # int(): a runner may hand over numpy integers; keep the request's lists plain.
            new_ids = [int(t) for t in sampled_token_ids.get(rid, ())]
            num_draft = item.num_draft_tokens
            if len(new_ids) > num_draft + 1:
                raise ValueError(f"request {rid!r}: {len(new_ids)} tokens for a step that "
                                 f"verified {num_draft} drafts")
            # Drafts after the first rejected one: their KV is garbage, overwritten later.
            num_rejected = num_draft - len(new_ids) + 1 if num_draft and new_ids else 0
            if running:
                if request.num_computed_tokens != item.start_position:
                    raise RuntimeError(
                        f"request {rid!r}: output of a step applied twice or out of order"
                    )
                request.num_computed_tokens += item.num_tokens - num_rejected
                request.num_inflight_tokens -= item.num_tokens
                if not item.do_sample:
                    kv.cache_blocks(request, request.num_computed_tokens)
            # Else preempted after this step was scheduled (async scheduling): its KV is gone,
            # but a sampled token is kept, so a seeded stream stays the same.
            if not item.do_sample:
                if new_ids:
                    raise ValueError(f"request {rid!r}: token sampled from a partial prefill")
                if running and request.pooling \
                        and request.num_computed_tokens >= request.num_prompt_tokens:
                    request.status = RequestStatus.FINISHED_STOPPED
                    self.running.remove(request)
                    self._free_request(request)
                    outputs.append(RequestResult(rid, [], request.finish_reason, None,
                                                 request.num_cached_tokens))
                continue
            if not new_ids:
                raise ValueError(f"request {rid!r}: no sampled token for a do_sample step")
            request.num_output_placeholders -= 1
            end = finish_after.get(rid) if finish_after else None
            kept = new_ids if end is None or end.num_tokens is None else new_ids[:end.num_tokens]
            accepted: list[int] = []
            for token_id in kept:
                request.append_output_token_ids(token_id)
                accepted.append(token_id)
                if check_stop(request, self.config.max_model_len):
                    break
            if end is not None and not request.is_finished:
                status, reason = end.status, end.reason
                if not status.is_finished:
                    raise ValueError(f"request {rid!r}: {status!r} is not a finished status")
                request.status, request.stop_reason = status, reason
            if running:
                # After the tokens are appended: blocks are registered under the hash of the
                # tokens they hold, and accepted drafts are computed tokens too.
                kv.cache_blocks(request, request.num_computed_tokens)
            if request.is_finished:
                (self.running if running else self.waiting).remove(request)
                self._free_request(request)
            elif num_rejected and running:
                # The rejected drafts' blocks go back; the next token's position (and the
                # lookahead past it) is kept.
                num_kept = request.num_computed_tokens + request.num_inflight_tokens + 1
                kept = kv.truncate(request, num_kept + self._lookahead(request, 1,
                                                                       num_kept - 1))
                if kept is not None:
                    self._truncated[rid] = kept
            num_accepted = len(new_ids) - 1 if num_draft else 0
            if num_draft:
                self.num_spec_drafts += 1
                self.num_spec_draft_tokens += num_draft
                self.num_spec_accepted_tokens += num_accepted
            outputs.append(
                RequestResult(
                    rid,
                    accepted,
                    request.finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                    num_draft,
                    num_accepted,
                )
            )
        return outputs
