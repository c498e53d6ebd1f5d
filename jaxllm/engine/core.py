"""EngineCore: owns the model and the scheduler.

Built from EngineArgs alone, it loads the weights, sizes the KV array (on a GPU from a measured
activation footprint), compiles every step shape, then runs steps:
schedule -> execute model -> sample (`HostSampler`, jaxllm/sample/host_sampler.py) ->
update_from_output -> EngineCoreOutputs (+ stats); with speculative decoding the worker's
`Drafter` then proposes the next step's drafts, handed to `Scheduler.update_draft_token_ids`.
Everything else the frontend needs from it goes through `UTILITY_METHODS` (vLLM's utility calls;
`collective_rpc` reaches the model runner), so the core can live in another process.

A request with structured outputs waits in the core, outside the scheduler, until its grammar
is compiled (`StructuredOutputManager`, on threads); only then does the scheduler see it. Its
matcher takes the tokens sampled for it before the scheduler does (`_advance_matchers`), which
decides whether they end it: when its grammar is complete the request finishes "stop" (tokens
past the grammar's end are dropped), when the matcher refuses a token "error";
`update_from_output` applies that decision with the tokens. Preemption recomputes and keeps the
output tokens, so the matcher never goes back. A grammar that fails to compile or reaches a
dead end finishes the request "error" too, with stop_reason saying why.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxllm.config import CUDA_GRAPH_TRITON_XLA_FLAGS, LaunchConfig, platform_env
from jaxllm.distributed import multihost
from jaxllm.engine import UTILITY_METHODS as UTILITY_METHODS
from jaxllm.engine import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.lora.adapter import check_lora_model
from jaxllm.lora.request import LoRARequest
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.pooling_params import PoolingParams, wrong_runner
from jaxllm.sample.host_sampler import NOTHING_SAMPLED, HostSampler, SampledTokens
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.state import SamplingState, SamplingStates
from jaxllm.structured_output.manager import StructuredOutputManager
from jaxllm.worker.drafter import Drafter
from jaxllm.worker.model_runner import (
    PROMPT_LOGPROB_ROWS,
    ModelRunner,
    ModelRunnerOutput,
    PreparedStep,
    StepHandle,
    num_kv_blocks_for,
)
from jaxllm.worker.pooler import Pooler, embedding_head
from scheduler import (
    FinishAfter,
    Request,
    RequestResult,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


def _adapter_counts(requests: Iterable[Request], adapters: Mapping[int, LoRARequest]
                    ) -> dict[str, int]:
    """How many of `requests` run each LoRA adapter, by the adapter's name."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_int_id:
            name = adapters[r.lora_int_id].lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts

# While only requests waiting for their grammar are held, how long the core blocks on the
# compilations before it returns an (empty) step: short, so aborts and new requests still get in.
GRAMMAR_WAIT_S = 0.05


@dataclass
class _FinishedStep:
    """Async scheduling: step N once sampled, with the tokens step N+1's placeholders take."""

    scheduler_output: SchedulerOutput
    out: ModelRunnerOutput
    sampled: SampledTokens
    stats: SchedulerStats
    placeholder_tokens: np.ndarray | None


def apply_platform_env(launch_config: LaunchConfig) -> None:
    """Put `platform_env` (the XLA flags of CUDA graphs) in this process's environment, which
    XLA reads once, when JAX starts its backend: after that it is too late, and a clear error
    says what to do. A core process finds them there already (its client set them)."""
    wanted = platform_env(launch_config, os.environ)
    if not wanted:
        return
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "cuda_graph_triton=True needs XLA_FLAGS set before JAX starts its backend, which "
            "this process already did; run the engine core in its own process "
            "(multiprocess_mode=True) or start Python with XLA_FLAGS="
            f"'{' '.join(CUDA_GRAPH_TRITON_XLA_FLAGS)}'")
    os.environ.update(wanted)


class EngineCore:
    def __init__(self, engine_args: EngineArgs, launch_config: LaunchConfig | None = None
                 ) -> None:
        """`launch_config`: the frontend's decisions; None (a core built alone, a multi-host
        follower): resolved here, for LLM."""
        self.engine_args = engine_args
        launch = launch_config or engine_args.create_launch_config()
        # Before JAX starts a backend: the environment it starts with, then, on several
        # hosts, jax.distributed.
        apply_platform_env(launch)
        self.distributed = multihost.start(launch.parallel_config)
        config = self.config = engine_args.create_engine_config(launch_config=launch)
        loaded = load_model(Path(config.model_path), dtype=jnp.dtype(config.dtype),
                            progress=config.show_progress, quantization=config.quantization,
                            kernel_backend=config.kernel_backend,
                            gguf_layout=config.gguf_layout)
        model_config = loaded.config
        max_model_len = config.max_model_len or model_config.max_context_len
        if max_model_len > model_config.max_context_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the "
                             f"{model_config.max_context_len} positions the model takes "
                             f"(max_position_embeddings "
                             f"{model_config.max_position_embeddings}, times the factor of a "
                             f"linear or YaRN RoPE scaling)")
        if config.enable_lora:
            check_lora_model(model_config)
        self.async_scheduling = config.async_scheduling
        self.runner = ModelRunner.from_engine_config(
            config, loaded, max_model_len, gemv_max_rows=config.gemv_max_rows,
            tensor_parallel_size=config.tensor_parallel_size,
            num_speculative_tokens=0 if config.speculative_config is None
            else config.speculative_config.num_speculative_tokens)
        num_blocks = multihost.agree(self.distributed, num_kv_blocks_for(config, self.runner))
        self.runner.initialize_kv_cache(num_blocks)
        compile_time_s = self.runner.compile(progress=config.show_progress)
        multihost.attach(self.distributed, self.runner, PROMPT_LOGPROB_ROWS)
        spec = config.speculative_config
        use_draft_model = spec is not None and spec.method == "draft_model"
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            block_size=config.block_size, num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            num_lookahead_tokens=0 if spec is None or not use_draft_model
            else spec.num_speculative_tokens,
            # A draft model reads the target's block tables with its own full attention:
            # nothing may be freed under it, even where every target layer slides.
            kv_group_windows=(None,) if use_draft_model else self.runner.kv_groups.windows,
            max_loras=config.max_loras if config.enable_lora else 0))
        self.info = EngineCoreInfo(
            config=config, model_config=model_config, max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            eos_token_ids=list(model_config.eos_token_ids) or (
                [] if model_config.eos_token_id is None else [model_config.eos_token_id]),
            bucket_shapes=self.runner.bucket_shapes(), compile_time_s=compile_time_s,
            kv_group_windows=self.scheduler.config.kv_group_windows)
        logger.info("KV cache: %d blocks of %d tokens, %d group(s) (windows %s); %.2f requests "
                    "of max_model_len (%d) tokens fit at once", num_blocks - 1,
                    config.block_size, len(self.info.kv_group_windows),
                    list(self.info.kv_group_windows), self.info.max_concurrency, max_model_len)
        if config.enable_lora:
            logger.info("LoRA: %d adapter slot(s) of rank %d, at most %d adapter(s) kept read "
                        "on the host (max_cpu_loras) besides those of unfinished requests",
                        config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        self.sampling_states = SamplingStates()
        # Built at the first constrained request (loads the tokenizer then).
        self.structured_output_manager: StructuredOutputManager | None = None
        # Constrained requests whose grammar is still compiling, in arrival order.
        self._waiting_for_grammar: dict[str, Request] = {}
        # Outputs of requests the core finished outside a step (grammar that did not compile).
        self._pending_outputs: list[EngineCoreOutput] = []
        # The scheduler's live request map itself (it is never rebound): the sampler reads
        # each step's requests as the scheduler holds them, with no copy to keep in step.
        self.sampler = HostSampler(self.scheduler.requests, self.sampling_states,
                                   candidates=self.runner.top_k > 0)
        # Async scheduling: the dispatched step whose results are not applied yet.
        self._inflight: tuple[SchedulerOutput, StepHandle, SchedulerStats] | None = None
        # Speculative decoding: the worker's drafter proposes drafts for at most as many
        # requests as the largest spec-decode bucket verifies.
        if spec is not None and self.async_scheduling:
            raise ValueError("speculative decoding runs without async scheduling: build the "
                             "config with EngineArgs.create_engine_config()")
        # The pooling runner: embedding requests' prompt rows pooled as their steps finish,
        # and each one's PoolingParams until it ends.
        self.pooler = None if config.pooler_config is None else Pooler(config.pooler_config)
        self._pooling_params: dict[str, PoolingParams] = {}
        self.drafter = None if spec is None else Drafter(
            config, model_config, max_model_len, num_blocks, loaded,
            max(self.runner.spec_buckets, default=0) // self.runner.spec_query_len)

    # --- requests in and out ----------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Everything that can raise runs before the scheduler is touched,
        so a refused request leaves no trace."""
        params = req.sampling_params
        state = SamplingState.from_request(req)  # refuses a bad seed
        eos_ids = set(req.eos_token_ids)
        eos = min(eos_ids) if eos_ids else None
        # Further EOS ids (generation configs may list several) stop like stop tokens.
        extra_stop = sorted(eos_ids - {eos}) if not params.ignore_eos else []
        pooling = req.pooling_params is not None
        if pooling != (self.pooler is not None):
            raise ValueError(f"request {req.request_id!r}: "
                             + wrong_runner("pooling" if self.pooler is not None else "generate"))
        request = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens, min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos, eos_token_id=eos,
            stop_token_ids=list(params.stop_token_ids or ()) + extra_stop, sampling_params=params,
            skip_prefix_cache=params.prompt_logprobs is not None or (
                self.pooler is not None and not self.pooler.uses_prefix_cache),
            pooling=pooling,
            lora_int_id=0 if req.lora_request is None else req.lora_request.lora_int_id)
        if req.lora_request is not None:
            self.runner.add_lora(req.lora_request)
        if req.request_id in self._waiting_for_grammar:
            raise ValueError(f"request id {req.request_id!r} is already in the engine core")
        if params.structured_outputs is not None:
            self.scheduler.check_request(request)
            so = state.structured_output = self._structured_output().add_request(
                params.structured_outputs,
                sorted(set(req.eos_token_ids) | set(self.info.eos_token_ids)))
            so.reasoning_end_token_id = req.reasoning_end_token_id
            so.reasoning_start_token_id = req.reasoning_start_token_id
            self._waiting_for_grammar[req.request_id] = request
        else:
            self.scheduler.add_request(request)  # validates before it changes anything
        self.sampling_states.add(state)
        if req.pooling_params is not None:
            self._pooling_params[req.request_id] = req.pooling_params
        if req.lora_request is not None:
            slots = self.runner.lora_slots
            assert slots is not None  # add_lora refused the request otherwise
            slots.pin(req.request_id, req.lora_request.lora_int_id)

    def _structured_output(self) -> StructuredOutputManager:
        if self.structured_output_manager is None:
            self.structured_output_manager = StructuredOutputManager(
                self.config.model_path, self.info.model_config.vocab_size,
                self.config.max_num_seqs)
            self.sampler.structured_output = self.structured_output_manager
        return self.structured_output_manager

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._waiting_for_grammar.pop(rid, None)
            self.sampling_states.remove(rid)
            self._forget_pooling(rid)
            if self.drafter is not None:
                self.drafter.remove(rid)
        self._unpin_loras(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._waiting_for_grammar)

    # --- one step -----------------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Hand the requests whose grammar is compiled to the scheduler (in arrival order);
        finish those whose grammar failed. With nothing else to run, first wait a little for a
        compilation instead of returning empty steps at once."""
        waiting = self._waiting_for_grammar
        if not waiting:
            return
        states = self.sampling_states
        pending = [so for rid in waiting if (so := states[rid].structured_output) is not None]
        if not any(so.is_ready for so in pending) and self._inflight is None \
                and not self.scheduler.has_unfinished_requests():
            StructuredOutputManager.wait_any(pending, GRAMMAR_WAIT_S)
        manager = self.structured_output_manager
        assert manager is not None  # requests wait for a grammar only once it exists
        for rid, request in list(waiting.items()):
            so = states[rid].structured_output
            assert so is not None
            if not so.is_ready:
                continue
            del waiting[rid]
            if manager.init_matcher(so):
                self.scheduler.add_request(request)  # checked when it arrived
            else:
                self._pending_outputs.append(EngineCoreOutput(
                    request_id=rid, new_token_ids=[], finish_reason="error",
                    stop_reason=so.error))
                self.sampling_states.remove(rid)

    def step(self) -> EngineCoreOutputs:
        """One step: with async scheduling, the outputs of the step dispatched by the previous
        call (see step_with_batch_queue); else schedule, run, sample and return this one."""
        self._admit_compiled()
        if self.async_scheduling:  # never with speculative decoding (resolve_async_scheduling)
            return self.step_with_batch_queue()
        stats = SchedulerStats()
        scheduler_output = self._schedule(stats)
        if scheduler_output.is_empty:
            self.runner.update_states(scheduler_output)
            return self._update(scheduler_output, None, NOTHING_SAMPLED, stats)
        out = self.runner.execute_model(scheduler_output,
                                        self.sampling_states.prompt_logprob_positions(
                                            scheduler_output.scheduled))
        sampled = self.sampler.sample(out, self.sampler.prepare(out.handle.prepared), stats)
        self.runner.release(out)
        return self._update(scheduler_output, out, sampled, stats)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Async scheduling (vLLM's name), three steps: prepare step N+1 while step N runs,
        sample N once its candidates are on the host, dispatch N+1 with N's tokens in its
        placeholders. Only then N's results are applied (scheduler update, outputs) and
        returned (none on the call that starts the pipeline). The host's critical section,
        from N's candidates being on the host to N+1's dispatch, is sampling and the dispatch
        itself."""
        stats = SchedulerStats()  # travels with the step it schedules
        scheduler_output = self._schedule(stats)
        prepared = self._prepare_next(scheduler_output)
        finished = self._sample_inflight(prepared)
        if prepared is not None:
            self._dispatch_next(scheduler_output, prepared, stats, finished)
        if finished is not None:
            return self._update(finished.scheduler_output, finished.out, finished.sampled,
                                finished.stats)
        if prepared is None:  # nothing ran: what schedule() itself finished, if anything
            return self._update(scheduler_output, None, NOTHING_SAMPLED, stats)
        # The pipeline starts: no step's results yet.
        return self._update(SchedulerOutput(), None, NOTHING_SAMPLED, SchedulerStats())

    def _prepare_next(self, scheduler_output: SchedulerOutput) -> PreparedStep | None:
        """Step N+1's host inputs, built while step N runs; None when it runs no tokens."""
        if scheduler_output.is_empty:
            self.runner.update_states(scheduler_output)
            return None
        return self.runner.prepare(scheduler_output)

    def _sample_inflight(self, next_step: PreparedStep | None) -> _FinishedStep | None:
        """Step N, if one is in flight: everything sampling needs but the candidates while it
        still runs, then its candidates on the host, sampled."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        scheduler_output, handle, stats = inflight
        inputs = self.sampler.prepare(handle.prepared)
        positions = None
        if next_step is not None and next_step.placeholder_req_ids:
            positions = inputs.positions_of(next_step.placeholder_req_ids)
        out = self.runner.wait(handle)
        self.runner.add_prompt_logprobs(out, self.sampling_states.prompt_logprob_positions(
            scheduler_output.scheduled))
        sampled = self.sampler.sample(out, inputs, stats)
        self.runner.release(out)
        return _FinishedStep(scheduler_output, out, sampled, stats,
                             None if positions is None else sampled.tokens_for(positions))

    def _dispatch_next(self, scheduler_output: SchedulerOutput, prepared: PreparedStep,
                       stats: SchedulerStats, finished: _FinishedStep | None) -> None:
        """Step N+1 on the device, its placeholders filled with step N's tokens; in flight
        until the next call."""
        handle = self.runner.dispatch(
            prepared, None if finished is None else finished.placeholder_tokens)
        if finished is not None:
            finished.stats.host_critical_s = handle.dispatch_time - finished.out.ready_time
            finished.stats.launch_s = handle.launched_time - handle.dispatch_time
        self._inflight = (scheduler_output, handle, stats)

    def _schedule(self, stats: SchedulerStats) -> SchedulerOutput:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self.drafter is not None:
            self.drafter.update_states(scheduler_output)
        stats.schedule_s = time.perf_counter() - t0
        stats.num_preemptions = len(scheduler_output.preempted_req_ids)
        stats.prefix_cache_queries = scheduler_output.num_prefix_cache_queries
        stats.prefix_cache_hits = scheduler_output.num_prefix_cache_hits
        return scheduler_output

    def _update(self, scheduler_output: SchedulerOutput, out: ModelRunnerOutput | None,
                sampled: SampledTokens, stats: SchedulerStats) -> EngineCoreOutputs:
        """Apply a step's sampled tokens to the scheduler and build its outputs."""
        t0 = time.perf_counter()
        if out is not None:
            stats.step_shape = out.step_shape
            stats.prepare_s = out.timings.prepare_s
            stats.device_s = out.timings.device_s
            stats.transfer_s = out.timings.transfer_s
            for r in scheduler_output.scheduled:
                if r.do_sample and r.num_tokens == 1 + r.num_draft_tokens:
                    stats.num_decode_tokens += 1  # drafts are counted in spec_num_draft_tokens
                else:
                    stats.num_prefill_tokens += r.num_tokens
        for rid in sampled.errors:  # before the update, which then skips them
            self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ERROR)
        new_tokens: dict[str, Sequence[int]] = {
            rid: (t,) for rid, t in zip(sampled.req_ids, sampled.tokens.tolist(), strict=True)
            if rid not in sampled.errors}
        for j, verified in sampled.verified.items():
            new_tokens[sampled.req_ids[j]] = verified.token_ids
        grammar_ends = self._advance_matchers(new_tokens) \
            if self.sampling_states.num_constrained else {}
        ends = dict(grammar_ends)
        for rid, why in sampled.errors_after_drafts.items():
            # A grammar that ends the request among those drafts ends it first.
            ends.setdefault(rid, FinishAfter(RequestStatus.FINISHED_ERROR, why))
        pooled = self._pool(scheduler_output, out) if out is not None else {}
        results = self.scheduler.update_from_output(scheduler_output, new_tokens, ends)
        outputs = self._make_outputs(results, stats)
        by_id = {o.request_id: o for o in outputs.outputs}
        for rid, vector in pooled.items():
            o = by_id.get(rid)
            if o is not None and o.finish_reason == "stop":
                assert self.pooler is not None  # only a pooling runner pools
                o.pooling_output = embedding_head(vector, self._pooling_params[rid],
                                                  self.pooler.config)
        for rid, why in sampled.errors.items():
            o = EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error",
                                 stop_reason=why)
            outputs.outputs.append(o)
            by_id[rid] = o
        for rid, end in grammar_ends.items():
            o = by_id.get(rid)
            if o is not None and end.status == RequestStatus.FINISHED_STOPPED \
                    and o.finish_reason == "stop" and o.stop_reason is None:
                # Its grammar ended it: the last token is text unless it is an EOS.
                o.stopped_on_text = o.new_token_ids[-1] not in \
                    self.sampling_states[rid].eos_token_ids
        if self.sampling_states.num_penalized:
            for o in outputs.outputs:
                self.sampling_states.append_output_tokens(o.request_id, o.new_token_ids)
        for j, lps in enumerate(sampled.logprobs):
            o = by_id.get(sampled.req_ids[j]) if lps is not None else None
            if o is None or not o.new_token_ids:
                continue
            o.new_sampled_logprobs = [float(sampled.logprobs_raw[j])]
            o.new_logprobs = lps
        for j, verified in sampled.verified.items():
            o = by_id.get(sampled.req_ids[j])
            if o is None or not o.new_token_ids or verified.logprobs is None:
                continue
            n = len(o.new_token_ids)  # tokens past a stop are dropped
            rows = verified.logprobs
            o.new_sampled_logprobs = verified.sampled_logprobs[:n]
            o.new_logprobs = LogprobsLists(rows.token_ids[:n], rows.logprobs[:n], rows.ranks[:n])
        if out is not None:
            for rid, prompt_stats in out.prompt_logprobs.items():
                rows = self.sampling_states.prompt_logprobs(rid, prompt_stats)
                if rows is None:
                    continue
                o = by_id.get(rid)
                if o is None:  # a prefill chunk that samples nothing
                    o = by_id[rid] = EngineCoreOutput(request_id=rid, new_token_ids=[])
                    outputs.outputs.append(o)
                o.new_prompt_logprobs = rows
        self._forget_finished(outputs)
        if self.drafter is not None:
            self.scheduler.update_draft_token_ids(self.drafter.propose_draft_token_ids(
                {o.request_id: o.new_token_ids for o in outputs.outputs
                 if o.new_token_ids and not o.finished},
                [o.request_id for o in outputs.outputs if o.finished], self.scheduler.running))
        stats.update_s = time.perf_counter() - t0
        return outputs

    def _advance_matchers(self, new_tokens: Mapping[str, Sequence[int]]
                          ) -> dict[str, FinishAfter]:
        """Before the scheduler sees them: feed each constrained request's matcher its sampled
        tokens, one by one. Returns the requests they end, for `update_from_output`: "stop"
        after the token that completes the grammar (accepted drafts past it are dropped),
        "error" when the matcher refuses a token."""
        ends: dict[str, FinishAfter] = {}
        for rid, tokens in new_tokens.items():
            state = self.sampling_states.get(rid)
            so = None if state is None else state.structured_output
            if so is None:
                continue
            first = 0
            if so.reasoning_start_token_id is not None:
                # The answer's first token: the think block's opening tag, or the answer.
                opened = tokens[0] == so.reasoning_start_token_id
                so.reasoning_start_token_id = None
                if opened:
                    first = 1
                else:
                    so.reasoning_end_token_id = None
            if so.is_reasoning:
                # The constraint starts after the think block's end, which may come with
                # tokens after it (accepted drafts, verified against the grammar's masks).
                end = so.reasoning_end_token_id
                assert end is not None  # is_reasoning
                rest = list(tokens[first:])
                if end not in rest:
                    continue
                first += rest.index(end) + 1
                so.reasoning_end_token_id = None
            for i in range(first, len(tokens)):
                token = tokens[i]
                if not so.accept_tokens([token]):
                    ends[rid] = FinishAfter(RequestStatus.FINISHED_ERROR, so.error)
                    break
                if so.is_terminated:
                    ends[rid] = FinishAfter(RequestStatus.FINISHED_STOPPED, None, i + 1)
                    break
        return ends

    def _pool(self, scheduler_output: SchedulerOutput, out: ModelRunnerOutput
              ) -> dict[str, np.ndarray]:
        """The raw pooled vectors of the pooling requests whose prompt this step completed
        (and the running sums of those it did not); empty on a generate runner."""
        if self.pooler is None:
            return {}
        requests = self.scheduler.requests
        lengths = {r.request_id: req.num_prompt_tokens for r in scheduler_output.scheduled
                   if (req := requests.get(r.request_id)) is not None and req.pooling
                   and req.arrival_index == r.arrival_index}
        if not lengths:
            return {}
        return self.pooler.pool_step(scheduler_output.scheduled, lengths,
                                     lambda: self.runner.hidden_rows(out))

    def _forget_pooling(self, request_id: str) -> None:
        if self.pooler is not None:
            self._pooling_params.pop(request_id, None)
            self.pooler.remove(request_id)

    def _forget_finished(self, outputs: EngineCoreOutputs) -> None:
        for o in outputs.outputs:
            if o.finished:
                self.sampling_states.remove(o.request_id)
                self._forget_pooling(o.request_id)
        self._unpin_loras([o.request_id for o in outputs.outputs if o.finished])

    def _unpin_loras(self, request_ids: list[str]) -> None:
        """Finished or aborted requests no longer keep their LoRA adapters read."""
        slots = self.runner.lora_slots
        if slots is not None and request_ids:
            slots.unpin(request_ids)

    def _make_outputs(self, results: list[RequestResult],
                      stats: SchedulerStats) -> EngineCoreOutputs:
        outputs = [EngineCoreOutput(
            request_id=r.request_id, new_token_ids=r.new_token_ids, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, num_cached_tokens=r.num_cached_tokens) for r in results]
        for r in results:
            if r.num_draft_tokens:
                stats.spec_num_drafts += 1
                stats.spec_num_draft_tokens += r.num_draft_tokens
                stats.spec_num_accepted_tokens += r.num_accepted_tokens
        if self._pending_outputs:
            outputs += self._pending_outputs
            self._pending_outputs = []
        num_running, num_waiting = self.scheduler.get_request_counts()
        stats.num_running_reqs = num_running
        stats.num_waiting_reqs = num_waiting + len(self._waiting_for_grammar)
        stats.kv_cache_usage = self.scheduler.usage
        slots = self.runner.lora_slots
        if slots is not None:
            stats.running_lora_adapters = _adapter_counts(self.scheduler.running, slots.requests)
            stats.waiting_lora_adapters = _adapter_counts(self.scheduler.waiting, slots.requests)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    # --- utility calls (UTILITY_METHODS) ------------------------------------------------------

    def get_engine_info(self) -> EngineCoreInfo:
        return self.info

    def get_kv_block_counts(self) -> tuple[int, int]:
        """(free, usable) KV blocks: all usable ones are free once no request holds any (free
        prefix-cached blocks count as free)."""
        return self.scheduler.num_free_blocks, self.scheduler.num_usable_blocks

    def get_scheduler_state(self) -> dict[str, int]:
        """The scheduler's counters as plain ints (what tests and checks assert on, in either
        engine mode): KV blocks free and usable, requests held (waiting, running, all; waiting
        includes those still waiting for their grammar) and preemptions since start; grammars
        compiled since start (the cache's misses)."""
        sched = self.scheduler
        num_running, num_waiting = sched.get_request_counts()
        num_for_grammar = len(self._waiting_for_grammar)
        manager = self.structured_output_manager
        return {"num_free_blocks": sched.num_free_blocks,
                "num_usable_blocks": sched.num_usable_blocks,
                "num_requests": num_running + num_waiting + num_for_grammar,
                "num_waiting_reqs": num_waiting + num_for_grammar,
                "num_waiting_for_grammar": num_for_grammar,
                "num_running_reqs": num_running,
                "num_preemptions": sched.num_preemptions,
                "num_grammars_compiled": 0 if manager is None else manager.num_compiled,
                "num_spec_drafts": sched.num_spec_drafts,
                "num_spec_draft_tokens": sched.num_spec_draft_tokens,
                "num_spec_accepted_tokens": sched.num_spec_accepted_tokens}

    def collective_rpc(self, method: str, args: list | tuple = ()) -> Any:
        """Call a public method of the model runner (vLLM's collective_rpc; one runner drives
        every device here, so one result): what benchmarks and profilers read from the worker
        (step-shape counts, weight stats, matmul timings) without the core knowing of it."""
        fn = None
        if isinstance(method, str) and not method.startswith("_"):
            fn = getattr(self.runner, method, None)
        if not callable(fn):
            raise ValueError(f"collective_rpc: the model runner has no public method {method!r}")
        return fn(*args)
