"""EngineCore: owns the model and the scheduler.

Built from EngineArgs alone, it loads the weights, sizes the KV array (on a GPU from a measured
activation footprint), compiles every step shape, then runs steps:
schedule -> execute model -> sample -> update_from_output -> EngineCoreOutputs (+ stats).
Everything else the frontend needs from it goes through `UTILITY_METHODS` (vLLM's utility calls),
so the core can live in another process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxllm.config import num_kv_blocks_for
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
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.sample.candidates import exact_rows, sample_from_topk
from jaxllm.sample.logprobs import LogprobsLists
from jaxllm.sample.metadata import SamplingMetadata
from jaxllm.sample.penalties import PenaltyState
from jaxllm.sample.sampler import SamplingRow, needs_processing, sample
from jaxllm.worker.matmul_timing import time_runner_matmuls, weight_stats
from jaxllm.worker.model_runner import (
    PROMPT_LOGPROB_ROWS,
    ModelRunner,
    ModelRunnerOutput,
    PreparedStep,
    PromptLogprobRows,
    StepHandle,
)
from scheduler import Request, RequestResult, Scheduler, SchedulerConfig, SchedulerOutput


@dataclass
class _SampleInputs:
    """What sampling a step's rows needs from the core, gathered while the step runs (off the
    host's critical path): the rows whose request is still here, their parameters, whether
    each needs logits processing now, and each random row's draw."""

    live: np.ndarray  # [n] positions among the step's sampled rows
    reqs: list[Request]
    req_ids: list[str]
    md: SamplingMetadata
    processed: np.ndarray  # [n] bool
    u: np.ndarray  # [n] float64 (0 for greedy rows)


@dataclass
class _Sampled:
    """A step's sampled tokens, per live row: the token, its raw logprob and (when asked) its
    logprob row."""

    req_ids: list[str]
    tokens: np.ndarray  # [n] int64
    logprobs_raw: np.ndarray  # [n] float32
    logprobs: list[LogprobsLists | None]

    def tokens_for(self, src: np.ndarray) -> np.ndarray:
        """Tokens at positions `src`, 0 where src is -1 (a request no longer here)."""
        return np.append(self.tokens, 0)[src]


_NOTHING_SAMPLED = _Sampled([], np.zeros(0, np.int64), np.zeros(0, np.float32), [])


class EngineCore:
    def __init__(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        # Several hosts: join jax.distributed before JAX starts a backend.
        self.distributed = multihost.start(engine_args)
        config = self.config = engine_args.create_engine_config()
        loaded = load_model(Path(config.model_path), dtype=jnp.dtype(config.dtype),
                            progress=config.show_progress, quantization=config.quantization,
                            kernel_backend=config.kernel_backend)
        model_config = loaded.config
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {model_config.max_position_embeddings}")
        self.async_scheduling = config.async_scheduling
        self.runner = ModelRunner(
            model_config, loaded.params, dtype=jnp.dtype(config.dtype),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            topk_sampling=config.topk_sampling, gemv_params=loaded.gemv_params,
            gemv_max_rows=config.gemv_max_rows, kv_cache_dtype=jnp.dtype(config.kv_cache_dtype),
            activation_dtype=jnp.dtype(config.activation_dtype),
            tensor_parallel_size=config.tensor_parallel_size)
        num_blocks = multihost.agree(self.distributed, num_kv_blocks_for(config, self.runner))
        self.runner.initialize_kv_cache(num_blocks)
        compile_time_s = self.runner.compile(progress=config.show_progress)
        multihost.attach(self.distributed, self.runner, PROMPT_LOGPROB_ROWS)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            block_size=config.block_size, num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching))
        self.info = EngineCoreInfo(
            config=config, model_config=model_config, max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            eos_token_ids=[] if model_config.eos_token_id is None
            else [model_config.eos_token_id],
            bucket_shapes=self.runner.bucket_shapes(), compile_time_s=compile_time_s)
        self._generators: dict[str, np.random.Generator] = {}
        self._eos: dict[str, frozenset[int]] = {}
        # Async scheduling: the dispatched step whose results are not applied yet.
        self._inflight: tuple[SchedulerOutput, StepHandle, SchedulerStats] | None = None
        self._requests: dict[str, EngineCoreRequest] = {}
        # Next prompt position whose logprob entry is still owed (survives preemption, so a
        # recomputed prompt does not emit its entries twice).
        self._prompt_lp_next: dict[str, int] = {}
        # Penalty statistics of the requests that use penalties, updated by each new token.
        self._penalties: dict[str, PenaltyState] = {}

    # --- requests in and out ----------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Everything that can raise runs before the scheduler is touched,
        so a refused request leaves no trace."""
        sp = req.sampling_params
        eos_ids = set(req.eos_token_ids)
        eos = min(eos_ids) if eos_ids else None
        # Further EOS ids (generation configs may list several) stop like stop tokens.
        extra_stop = sorted(eos_ids - {eos}) if not sp.ignore_eos else []
        request = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens, min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos,
            eos_token_id=eos, stop_token_ids=list(sp.stop_token_ids) + extra_stop,
            sampling_params=sp, skip_prefix_cache=sp.prompt_logprobs is not None)
        try:
            generator = np.random.default_rng(req.seed)
        except (ValueError, TypeError) as e:
            raise ValueError(f"request {req.request_id!r}: bad seed {req.seed!r}: {e}") from e
        self.scheduler.add_request(request)  # validates before it changes anything
        self._requests[req.request_id] = req
        self._generators[req.request_id] = generator
        self._eos[req.request_id] = frozenset(req.eos_token_ids)
        if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
            self._penalties[req.request_id] = PenaltyState(req.prompt_token_ids)
        if sp.prompt_logprobs is not None:
            self._prompt_lp_next[req.request_id] = 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        for rid in request_ids:
            self._forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._generators.pop(rid, None)
        self._eos.pop(rid, None)
        self._prompt_lp_next.pop(rid, None)
        self._penalties.pop(rid, None)

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One step: with async scheduling, the outputs of the step dispatched by the previous
        call (see step_with_batch_queue); else schedule, run, sample and return this one."""
        if self.async_scheduling:
            return self.step_with_batch_queue()
        stats = SchedulerStats()
        so = self._schedule(stats)
        if so.is_empty:
            self.runner.update_states(so)
            return self._update(so, None, _NOTHING_SAMPLED, stats)
        out = self.runner.execute_model(so, self._prompt_rows(so))
        sampled = self._sample(out, self._sample_inputs(out.handle.prepared), stats)
        self.runner.release(out)
        return self._update(so, out, sampled, stats)

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Async scheduling (vLLM's name): schedule and prepare step N+1 while step N runs,
        then wait for N's small outputs, sample, fill N+1's placeholder tokens and dispatch it;
        only then apply N's results (scheduler update, outputs). Returns step N's outputs (none
        on the call that starts the pipeline). The host's critical section, from N's
        candidates being on the host to N+1's dispatch, is sampling and the dispatch itself.
        """
        stats = SchedulerStats()  # travels with the step it schedules
        so = self._schedule(stats)
        prepared = self.runner.prepare(so) if not so.is_empty else None
        if prepared is None:
            self.runner.update_states(so)
        inflight, self._inflight = self._inflight, None
        sampled, out = _NOTHING_SAMPLED, None
        if inflight is not None:
            prev_so, handle, prev_stats = inflight
            # Everything sampling needs but the candidates, while step N still runs.
            inputs = self._sample_inputs(handle.prepared)
            src = None
            if prepared is not None and prepared.placeholder_req_ids:
                pos = {rid: j for j, rid in enumerate(inputs.req_ids)}
                src = np.fromiter((pos.get(rid, -1) for rid in prepared.placeholder_req_ids),
                                  np.intp, len(prepared.placeholder_req_ids))
            out = self.runner.wait(handle)
            self.runner.add_prompt_logprobs(out, self._prompt_rows(prev_so))
            sampled = self._sample(out, inputs, prev_stats)
            self.runner.release(out)
        if prepared is not None:
            handle = self.runner.dispatch(
                prepared, None if out is None or src is None else sampled.tokens_for(src))
            if out is not None:
                prev_stats.host_critical_s = handle.dispatch_time - out.ready_time
                prev_stats.launch_s = handle.launched_time - handle.dispatch_time
            self._inflight = (so, handle, stats)
        if inflight is not None:
            return self._update(prev_so, out, sampled, prev_stats)
        if prepared is None:  # nothing ran: what schedule() itself finished, if anything
            return self._update(so, None, _NOTHING_SAMPLED, stats)
        # The pipeline starts: no step's results yet.
        return self._update(SchedulerOutput(), None, _NOTHING_SAMPLED, SchedulerStats())

    def _schedule(self, stats: SchedulerStats) -> SchedulerOutput:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        stats.schedule_s = time.perf_counter() - t0
        stats.num_preemptions = len(so.preempted_req_ids)
        stats.prefix_cache_queries = so.num_prefix_cache_queries
        stats.prefix_cache_hits = so.num_prefix_cache_hits
        return so

    def _prompt_rows(self, so: SchedulerOutput) -> dict[str, tuple[int, list[int]]]:
        """Request id -> (first prompt position of this step whose logprob entry is still owed,
        relative to the request's start in the step; the next prompt token of each owed
        position). Position p predicts token p + 1: entries for p < num_prompt - 1. Positions
        emitted before a preemption are not owed again."""
        if not self._prompt_lp_next:
            return {}
        want = {}
        for r in so.scheduled:
            next_pos = self._prompt_lp_next.get(r.request_id)
            if next_pos is None:
                continue
            prompt = self._requests[r.request_id].prompt_token_ids
            first = max(r.start_position, next_pos)
            end = min(r.seq_len, len(prompt) - 1)
            if end > first:
                want[r.request_id] = (first - r.start_position, list(prompt[first + 1:end + 1]))
        return want

    def _sample_inputs(self, prepared: PreparedStep) -> _SampleInputs:
        """The step's sampled rows whose request is still here (with async scheduling a row may
        belong to a request that finished or was aborted, or whose id was reused, since the
        step was scheduled), their parameters from the persistent batch, and their draws."""
        stamp = {r.request_id: r.arrival_index for r in prepared.so.scheduled}
        requests = self.scheduler.requests
        live, reqs = [], []
        for i, rid in enumerate(prepared.inputs.sample_req_ids):
            req = requests.get(rid)
            if req is not None and req.arrival_index == stamp[rid]:
                live.append(i)
                reqs.append(req)
        idx = np.asarray(live, np.intp)
        md = prepared.inputs.sampling
        if len(idx) < len(md):
            md = md.rows(idx)
        processed = np.zeros(len(idx), bool)
        for j in np.flatnonzero(md.maybe_processed).tolist():
            processed[j] = needs_processing(self._row(reqs[j]))
        u = np.zeros(len(idx))
        gens = self._generators
        for j in np.flatnonzero(~md.greedy).tolist():  # exactly one draw per sampled token
            u[j] = gens[reqs[j].request_id].random()
        return _SampleInputs(idx, reqs, [r.request_id for r in reqs], md, processed, u)

    def _sample(self, out: ModelRunnerOutput, inputs: _SampleInputs,
                stats: SchedulerStats) -> _Sampled:
        """Sample the live rows. Rows the device's top-K candidates sample exactly go through
        the vectorized candidate sampler, the rest through the full-row sampler on their
        fetched logits."""
        t0 = time.perf_counter()
        n = len(inputs.live)
        tokens = np.empty(n, np.int64)
        sampled_lp = np.full(n, np.nan, np.float32)
        logprobs: list[LogprobsLists | None] = [None] * n
        md, topk = inputs.md, out.topk
        if topk is not None:
            if n < len(out.sample_req_ids):
                topk = topk.rows(inputs.live)
            exact = exact_rows(md, inputs.processed, topk)
        else:
            exact = np.zeros(n, bool)
        fast = np.flatnonzero(exact)
        if fast.size:
            every = fast.size == n
            t, lp, lps = sample_from_topk(topk if every else topk.rows(fast),
                                          md if every else md.rows(fast), inputs.u[fast])
            tokens[fast], sampled_lp[fast] = t, lp
            for j in np.flatnonzero(md.num_logprobs[fast] >= 0).tolist():
                logprobs[int(fast[j])] = lps[j]
        full = np.flatnonzero(~exact)
        if full.size:
            full_rows = [self._row(inputs.reqs[i]) for i in full.tolist()]
            logits = out.logits_rows(inputs.live[full].tolist())
            if topk is not None:
                res = sample(logits, full_rows, lse=topk.lse[full], u=inputs.u[full])
            else:  # the raw log-normaliser costs a pass over the vocabulary: only when asked
                res = sample(logits, full_rows, u=inputs.u[full], all_sampled_logprobs=any(
                    r.params.logprobs is not None for r in full_rows))
            tokens[full], sampled_lp[full] = res.token_ids, res.sampled_logprobs
            for j, i in enumerate(full.tolist()):
                logprobs[i] = res.logprobs[j]
        stats.num_full_row_samples = int(full.size)
        stats.sample_s = time.perf_counter() - t0
        return _Sampled(inputs.req_ids, tokens, sampled_lp, logprobs)

    def _row(self, req: Request) -> SamplingRow:
        rid = req.request_id
        return SamplingRow(params=req.sampling_params, generator=self._generators[rid],
                           prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids, eos_token_ids=self._eos[rid],
                           penalties=self._penalties.get(rid))

    def _update(self, so: SchedulerOutput, out: ModelRunnerOutput | None,
                sampled: _Sampled, stats: SchedulerStats) -> EngineCoreOutputs:
        """Apply a step's sampled tokens to the scheduler and build its outputs."""
        t0 = time.perf_counter()
        if out is not None:
            stats.step_shape = out.step_shape
            stats.prepare_s = out.timings.prepare_s
            stats.device_s = out.timings.device_s
            stats.transfer_s = out.timings.transfer_s
            for r in so.scheduled:
                if r.do_sample and r.num_tokens == 1:
                    stats.num_decode_tokens += 1
                else:
                    stats.num_prefill_tokens += r.num_tokens
        results = self.scheduler.update_from_output(
            so, {rid: (t,) for rid, t in zip(sampled.req_ids, sampled.tokens.tolist(),
                                             strict=True)})
        outputs = self._make_outputs(results, stats)
        by_id = {o.request_id: o for o in outputs.outputs}
        for rid, state in self._penalties.items():
            o = by_id.get(rid)
            if o is not None:
                for token in o.new_token_ids:
                    state.append(token)
        for j, lps in enumerate(sampled.logprobs):
            o = by_id.get(sampled.req_ids[j]) if lps is not None else None
            if o is None or not o.new_token_ids:
                continue
            o.new_sampled_logprobs = [float(sampled.logprobs_raw[j])]
            o.new_logprobs = lps
        if out is not None:
            for rid, rows in out.prompt_logprobs.items():
                self._emit_prompt_logprobs(rid, rows, by_id, outputs.outputs)
        self._forget_finished(outputs)
        stats.update_s = time.perf_counter() - t0
        return outputs

    def _forget_finished(self, outputs: EngineCoreOutputs) -> None:
        for o in outputs.outputs:
            if o.finished:
                self._forget(o.request_id)

    def _make_outputs(self, results: list[RequestResult],
                      stats: SchedulerStats) -> EngineCoreOutputs:
        outputs = [EngineCoreOutput(
            request_id=r.request_id, new_token_ids=r.new_token_ids, finish_reason=r.finish_reason,
            stop_reason=r.stop_reason, num_cached_tokens=r.num_cached_tokens) for r in results]
        sched = self.scheduler
        stats.num_running_reqs = len(sched.running)
        stats.num_waiting_reqs = len(sched.waiting)
        stats.kv_cache_usage = sched.usage
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)

    def _emit_prompt_logprobs(self, rid: str, stats: PromptLogprobRows,
                              by_id: dict[str, EngineCoreOutput],
                              outputs: list[EngineCoreOutput]) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        num = req.sampling_params.prompt_logprobs
        rows = LogprobsLists([], [], [])
        targets = req.prompt_token_ids[stats.first_position + 1:]
        for i in range(len(stats.lse)):
            lse = float(stats.lse[i])
            rows.token_ids.append([int(targets[i])] + stats.token_ids[i, :num].tolist())
            rows.logprobs.append([float(stats.target_logit[i]) - lse]
                                 + [v - lse for v in stats.values[i, :num].tolist()])
            rows.ranks.append([int(stats.target_rank[i])] + list(range(1, num + 1)))
        self._prompt_lp_next[rid] = stats.first_position + len(stats.lse)
        o = by_id.get(rid)
        if o is None:
            o = EngineCoreOutput(request_id=rid, new_token_ids=[])
            outputs.append(o)
            by_id[rid] = o
        o.new_prompt_logprobs = rows

    # --- utility calls (UTILITY_METHODS) ------------------------------------------------------

    def get_engine_info(self) -> EngineCoreInfo:
        return self.info

    def get_kv_block_counts(self) -> tuple[int, int]:
        """(free, usable) KV blocks: all usable ones are free once no request holds any (free
        prefix-cached blocks count as free)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_free_blocks, pool.num_usable_blocks

    def get_step_shape_counts(self) -> list[tuple[int, int, int]]:
        """(num_tokens, max_query_len, steps) of every step shape run since the last reset."""
        return [(t, q, n) for (t, q), n in sorted(self.runner.step_shape_counts.items())]

    def reset_step_shape_counts(self) -> None:
        self.runner.step_shape_counts.clear()

    def get_weight_stats(self) -> dict[str, int]:
        return weight_stats(self.runner)

    def time_weight_matmuls(self, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
        """The benchmarks' matmul floor (it needs the weights, which only the core holds)."""
        return time_runner_matmuls(self.runner, num_tokens, reps)
