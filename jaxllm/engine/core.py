"""EngineCore: one step = schedule -> execute model -> sample -> update_from_output.

Plus the in-process EngineCoreClient (vLLM's InprocClient): the engine core runs in the caller's
thread; `get_output()` runs one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from jaxllm.sample.sampler import SamplingRow, compute_prompt_logprobs, sample
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.model_runner import ModelRunner, StepTimings
from scheduler import EngineCoreOutput, Request, Scheduler, SchedulerConfig


@dataclass
class EngineCoreRequest:
    """A validated, tokenized request as the engine core receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    seed: int | list[int]  # seeds this request's own numpy Generator
    max_tokens: int  # already capped by max_model_len
    arrival_time: float = field(default_factory=time.time)


@dataclass
class StepStats:
    """Host time of the last step, split by phase (for profiling)."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    schedule_s: float = 0.0
    runner: StepTimings = field(default_factory=StepTimings)
    sample_s: float = 0.0
    update_s: float = 0.0


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler_config: SchedulerConfig) -> None:
        self.runner = runner
        self.scheduler = Scheduler(scheduler_config)
        self._generators: dict[str, np.random.Generator] = {}
        self._requests: dict[str, EngineCoreRequest] = {}
        # Next prompt position whose logprob entry is still owed (survives preemption, so a
        # recomputed prompt does not emit its entries twice).
        self._prompt_lp_next: dict[str, int] = {}
        self.last_stats = StepStats()

    def add_request(self, req: EngineCoreRequest) -> None:
        sp = req.sampling_params
        eos = min(req.eos_token_ids) if req.eos_token_ids else None
        # Further EOS ids (generation configs may list several) stop like stop tokens.
        extra_stop = sorted(req.eos_token_ids - {eos}) if not sp.ignore_eos else []
        request = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens, min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos,
            eos_token_id=eos, stop_token_ids=list(sp.stop_token_ids) + extra_stop,
            sampling_params=sp, skip_prefix_cache=sp.prompt_logprobs is not None)
        self.scheduler.add_request(request)
        self._requests[req.request_id] = req
        self._generators[req.request_id] = np.random.default_rng(req.seed)
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

    def step(self) -> list[EngineCoreOutput]:
        stats = StepStats()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        stats.schedule_s = t1 - t0
        if so.is_empty:
            outputs = self.scheduler.update_from_output(so, {})
            for out in outputs:
                if out.finished:
                    self._forget(out.request_id)
            self.last_stats = stats
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
        stats.runner = out.timings

        t2 = time.perf_counter()
        rows = []
        for rid in out.sample_req_ids:
            req = self.scheduler.requests[rid]
            rows.append(SamplingRow(
                params=req.sampling_params, generator=self._generators[rid],
                prompt_token_ids=req.prompt_token_ids, output_token_ids=req.output_token_ids,
                eos_token_ids=self._requests[rid].eos_token_ids))
        # The sampled token's raw logprob costs a pass over the vocabulary: only when asked.
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        sampled = sample(out.logits, rows, all_sampled_logprobs=want_logprobs) if rows else None
        t3 = time.perf_counter()
        stats.sample_s = t3 - t2

        sampled_ids = {}
        if sampled is not None:
            for i, rid in enumerate(out.sample_req_ids):
                sampled_ids[rid] = [int(sampled.token_ids[i])]
        outputs = self.scheduler.update_from_output(so, sampled_ids)
        by_id = {o.request_id: o for o in outputs}
        if sampled is not None:
            for i, rid in enumerate(out.sample_req_ids):
                o = by_id.get(rid)
                if o is None or not o.new_token_ids:
                    continue
                o.new_sampled_logprobs = [float(sampled.sampled_logprobs[i])]
                o.new_logprobs = [sampled.logprobs[i]]
        for rid, (logits, start) in out.prompt_logits.items():
            self._emit_prompt_logprobs(rid, logits, start, by_id, outputs)
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)
        stats.update_s = time.perf_counter() - t3
        self.last_stats = stats
        return outputs

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
        entries = compute_prompt_logprobs(logits[skip:], targets,
                                          req.sampling_params.prompt_logprobs)
        self._prompt_lp_next[rid] = first + len(entries)
        o = by_id.get(rid)
        if o is None:
            o = EngineCoreOutput(request_id=rid, new_token_ids=[])
            outputs.append(o)
            by_id[rid] = o
        o.new_prompt_logprobs = entries


class InprocClient:
    """vLLM's InprocClient: the engine core lives in this process and thread."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

