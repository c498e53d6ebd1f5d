"""EngineCore: owns the model and the scheduler.

Built from EngineArgs alone, it loads the weights, sizes the KV array (on a GPU from a measured
activation footprint), compiles every step shape, then runs steps:
schedule -> execute model -> sample -> update_from_output -> EngineCoreOutputs (+ stats).
Everything else the frontend needs from it goes through `UTILITY_METHODS` (vLLM's utility calls),
so the core can live in another process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxllm.engine import (
    EngineCoreInfo,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.model_executor.model_loader import load_model
from jaxllm.model_executor.model_loader.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_path,
)
from jaxllm.sample.penalties import PenaltyState
from jaxllm.sample.sampler import SamplingRow, compute_prompt_logprobs, sample
from jaxllm.worker.model_runner import ModelRunner, device_memory_bytes, kv_block_bytes
from scheduler import Request, RequestResult, Scheduler, SchedulerConfig

DEFAULT_CPU_KV_BYTES = 1 << 30
_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# What a client may call on the core besides add/abort/step (vLLM's call_utility).
UTILITY_METHODS = frozenset({"get_engine_info", "get_step_shape_counts",
                             "reset_step_shape_counts", "get_weight_stats",
                             "time_weight_matmuls"})


def resolve_dtype(name: str | None) -> Any:
    """None -> float32 on CPU, bfloat16 on GPU (bf16 GEMV is ~18x slower than f32 on CPU)."""
    import jax

    if name is None:
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return _JNP_DTYPES[name]


def num_kv_blocks_for(args: EngineArgs, runner: ModelRunner) -> int:
    """KV blocks from the memory budget. CPU: kv_cache_memory_bytes (default 1 GiB). GPU:
    gpu_memory_utilization of the device minus the weights and the measured activation bytes of
    the largest step (or kv_cache_memory_bytes when given)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    per_block = kv_block_bytes(runner.config, args.block_size, runner.kv_cache_dtype)
    total = device_memory_bytes()
    if args.kv_cache_memory_bytes is not None:
        budget, how = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif total is None:
        budget, how = DEFAULT_CPU_KV_BYTES, "the CPU default of 1 GiB"
    else:
        weights = runner.weight_bytes()
        activations = runner.measure_activation_bytes()
        budget = int(total * args.gpu_memory_utilization) - weights - activations
        how = (f"{args.gpu_memory_utilization} x {total} device bytes - {weights} of weights - "
               f"{activations} of activations (largest step, measured)")
    blocks = max(budget, 0) // per_block
    if blocks < 2:
        raise ValueError(f"the KV budget ({how}) holds {blocks} blocks of {per_block} bytes; "
                         f"raise kv_cache_memory_bytes or gpu_memory_utilization, or lower "
                         f"max_num_batched_tokens")
    return int(blocks)


class EngineCore:
    def __init__(self, engine_args: EngineArgs) -> None:
        args = self.engine_args = engine_args
        dtype = resolve_dtype(args.dtype)
        path = default_model_path() if args.model is None else Path(args.model)
        self.model_name = DEFAULT_MODEL_NAME if args.model is None else args.model
        loaded = load_model(path, dtype=dtype, progress=args.show_progress,
                            quantization=args.quantization)
        config = loaded.config
        max_model_len = args.max_model_len or config.max_position_embeddings
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {config.max_position_embeddings}")
        backend = args.kernel_backend or pallas_kernels.default_backend()
        self.runner = ModelRunner(
            config, loaded.params, dtype=dtype, kernel_backend=backend,
            block_size=args.block_size, max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            gemv_params=loaded.gemv_params)
        num_blocks = num_kv_blocks_for(args, self.runner)
        self.runner.initialize_kv_cache(num_blocks)
        compile_time_s = self.runner.compile(progress=args.show_progress)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max_model_len, block_size=args.block_size, num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching))
        self.info = EngineCoreInfo(
            model_name=self.model_name, model_config=config, dtype=jnp.dtype(dtype).name,
            kernel_backend=backend, max_model_len=max_model_len, block_size=args.block_size,
            num_kv_blocks=num_blocks,
            eos_token_ids=[] if config.eos_token_id is None else [config.eos_token_id],
            bucket_shapes=self.runner.bucket_shapes(), compile_time_s=compile_time_s)
        self._generators: dict[str, np.random.Generator] = {}
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
        self._prompt_lp_next.pop(rid, None)
        self._penalties.pop(rid, None)

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        stats = SchedulerStats()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        stats.schedule_s = time.perf_counter() - t0
        stats.num_preemptions = len(so.preempted_req_ids)
        stats.prefix_cache_queries = so.num_prefix_cache_queries
        stats.prefix_cache_hits = so.num_prefix_cache_hits
        if so.is_empty:
            self.runner.update_states(so)
            outputs = self._make_outputs(self.scheduler.update_from_output(so, {}), stats)
            self._forget_finished(outputs)
            return outputs
        sched_reqs = {r.request_id: r for r in so.scheduled}
        for r in so.scheduled:
            if r.do_sample and r.num_tokens == 1:
                stats.num_decode_tokens += 1
            else:
                stats.num_prefill_tokens += r.num_tokens

        # Prompt positions p predict token p + 1: rows for p < num_prompt - 1 are owed.
        want_prompt_rows = {}
        for rid in self._prompt_lp_next:
            r = sched_reqs.get(rid)
            if r is None:
                continue
            num_prompt = len(self._requests[rid].prompt_token_ids)
            want_prompt_rows[rid] = max(0, min(r.seq_len, num_prompt - 1) - r.start_position)
        out = self.runner.execute_model(so, want_prompt_rows)
        stats.step_shape = out.step_shape
        stats.prepare_s = out.timings.prepare_s
        stats.device_s = out.timings.device_s
        stats.transfer_s = out.timings.transfer_s

        t2 = time.perf_counter()
        rows = []
        for rid in out.sample_req_ids:
            req = self.scheduler.requests[rid]
            rows.append(SamplingRow(
                params=req.sampling_params, generator=self._generators[rid],
                prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
                eos_token_ids=frozenset(self._requests[rid].eos_token_ids),
                penalties=self._penalties.get(rid)))
        # The sampled token's raw logprob costs a pass over the vocabulary: only when asked.
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        sampled = sample(out.logits, rows, all_sampled_logprobs=want_logprobs) if rows else None
        t3 = time.perf_counter()
        stats.sample_s = t3 - t2

        sampled_ids = {}
        if sampled is not None:
            for i, rid in enumerate(out.sample_req_ids):
                sampled_ids[rid] = [int(sampled.token_ids[i])]
        results = self.scheduler.update_from_output(so, sampled_ids)
        outputs = self._make_outputs(results, stats)
        by_id = {o.request_id: o for o in outputs.outputs}
        for rid, state in self._penalties.items():
            o = by_id.get(rid)
            if o is not None:
                for token in o.new_token_ids:
                    state.append(token)
        if sampled is not None:
            for i, rid in enumerate(out.sample_req_ids):
                o = by_id.get(rid)
                if o is None or not o.new_token_ids or sampled.logprobs[i] is None:
                    continue
                o.new_sampled_logprobs = [float(sampled.sampled_logprobs[i])]
                o.new_logprobs = sampled.logprobs[i]
        for rid, (logits, start) in out.prompt_logits.items():
            self._emit_prompt_logprobs(rid, logits, start, by_id, outputs.outputs)
        self._forget_finished(outputs)
        stats.update_s = time.perf_counter() - t3
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

    def _emit_prompt_logprobs(self, rid: str, logits: np.ndarray, start: int,
                              by_id: dict[str, EngineCoreOutput],
                              outputs: list[EngineCoreOutput]) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        next_pos = self._prompt_lp_next[rid]
        skip = max(0, next_pos - start)
        if skip >= len(logits):
            return
        first = start + skip
        targets = req.prompt_token_ids[first + 1:first + 1 + len(logits) - skip]
        rows = compute_prompt_logprobs(logits[skip:], targets,
                                       req.sampling_params.prompt_logprobs)
        self._prompt_lp_next[rid] = first + len(rows)
        o = by_id.get(rid)
        if o is None:
            o = EngineCoreOutput(request_id=rid, new_token_ids=[])
            outputs.append(o)
            by_id[rid] = o
        o.new_prompt_logprobs = rows

    # --- utility calls (UTILITY_METHODS) ------------------------------------------------------

    def get_engine_info(self) -> EngineCoreInfo:
        return self.info

    def get_step_shape_counts(self) -> list[tuple[int, int, int]]:
        """(num_tokens, max_query_len, steps) of every step shape run since the last reset."""
        return [(t, q, n) for (t, q), n in sorted(self.runner.step_shape_counts.items())]

    def reset_step_shape_counts(self) -> None:
        self.runner.step_shape_counts.clear()

    def get_weight_stats(self) -> dict[str, int]:
        """body_params (decoder layers + final norm), head_params (LM head), itemsize, and
        decode_weight_bytes (the weights a 1-row decode step reads, in their stored formats)."""
        import jax

        params, cfg = self.runner.params, self.runner.config
        body = sum(int(x.size) for k, v in params.items()
                   if k not in ("embed_tokens", "lm_head") for x in jax.tree.leaves(v))
        # What a 1-row decode step reads: its own tree (quantized, or float32 GEMV copies).
        step = self.runner.params_for(1, 1)
        step_bytes = sum(int(x.nbytes) for k, v in step.items()
                         if k != "embed_tokens" or cfg.tie_word_embeddings
                         for x in jax.tree.leaves(v))
        return {"body_params": body, "head_params": cfg.vocab_size * cfg.hidden_size,
                "itemsize": int(np.dtype(params["norm"]["weight"].dtype).itemsize),
                "decode_weight_bytes": step_bytes}

    def time_weight_matmuls(self, num_tokens: list[int], reps: int = 3) -> dict[int, float]:
        """Best-of-`reps` seconds of one step's weight matmuls at each token count (the
        benchmarks' matmul floor; it needs the weights, which only the core holds)."""
        from jaxllm.worker.matmul_timing import time_weight_matmuls
        from jaxllm.worker.model_runner import MIN_TOKEN_BUCKET

        r = self.runner
        out: dict[int, float] = {}
        for n in num_tokens:  # each with its bucket's weights (fewer rows: decode buckets)
            tree = r.params_for(n, 1 if n < MIN_TOKEN_BUCKET else n)
            out.update(time_weight_matmuls(tree, r.config, r.dtype, r.max_num_seqs, [n], reps))
        return out
