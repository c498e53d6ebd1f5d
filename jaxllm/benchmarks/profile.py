"""`--profile`: a per-step split of host time (schedule, input preparation, device step, logits
transfer, sampling, scheduler update, detokenization, other) in decode steady state, from the
engine's per-step stats, and the host's critical path.

Synchronous steps run every phase one after another, so the phases partition the step. With
async scheduling the device runs step N while the host schedules and prepares N+1 and applies
N-1's results; the step's wall time is then the device step (dispatch to its candidates on the
host) plus the host's critical section (`host_critical`: candidates on the host to the next
dispatch: transfer, sampling, the dispatch), and "other" is the rest, i.e. host work the device
did not hide (from the means; 0 when the device step and the critical section fill the step).
The overlapped phases are still listed, with their own times."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from jaxllm.benchmarks.common import sampling_params
from jaxllm.benchmarks.datasets import TokenSampler
from jaxllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxllm import LLM

PROFILE_PHASES = ("schedule", "prepare_inputs", "device_step", "logits_transfer", "sampling",
                  "update", "detokenize", "other")
# With async scheduling the step is device_step + host_critical + other; these overlap them.
OVERLAPPED_PHASES = ("schedule", "prepare_inputs", "update", "detokenize")


@dataclass
class _StepRecord:
    wall_s: float
    parts: dict[str, float] = field(default_factory=dict)
    host_critical_s: float | None = None
    launch_s: float | None = None


def profile_steps(llm: LLM, sampler: TokenSampler, batch_sizes: list[int], input_len: int,
                  num_steps: int, seed: int = 0, warmup_steps: int = 2,
                  use_tqdm: bool = True, sampling: str = "greedy") -> list[dict[str, Any]]:
    """Host time per engine step in decode steady state (every request of the batch decoding,
    none prefilling), split by phase; mean over `num_steps` such steps after `warmup_steps`.
    "detokenize" is the engine's output processing (incremental detokenizing, RequestOutputs),
    as the engine times it; "update" is the scheduler's update_from_output; "other" is the
    step's wall time minus the rest. `sampling`: "greedy", or "seeded-top-k-top-p" (request i
    seeded with seed + i, temperature 0.8, top_k 50, top_p 0.9)."""
    engine = llm.llm_engine
    args = engine.engine_args
    rng = np.random.default_rng(seed)
    results = []
    for bs in batch_sizes:
        if bs > args.max_num_seqs or bs > args.max_num_batched_tokens:
            results.append({"batch_size": bs, "skipped":
                            f"batch {bs} exceeds max_num_seqs {args.max_num_seqs} or "
                            f"max_num_batched_tokens {args.max_num_batched_tokens}"})
            continue
        # Decode until enough steady steps are seen, then abort (the batch's prefills may take
        # any number of steps, mixed with the first requests' decodes).
        room = engine.max_model_len - input_len
        if room < 1 + warmup_steps + num_steps:
            raise ValueError(f"--profile-input-len {input_len} leaves {room} tokens of "
                             f"max_model_len {engine.max_model_len}; need "
                             f"{1 + warmup_steps + num_steps}")
        sp = sampling_params(room, True)
        ids = [f"profile-{bs}-{i}-{time.monotonic_ns()}" for i in range(bs)]
        for i, rid in enumerate(ids):
            if sampling != "greedy":
                sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=seed + i,
                                    max_tokens=room, ignore_eos=True)
            engine.add_request(rid, {"prompt_token_ids": sampler.sample(rng, input_len)}, sp)
        steady: list[_StepRecord] = []
        bar = tqdm(desc=f"profile batch {bs}", unit="step", disable=not use_tqdm)
        want = warmup_steps + num_steps
        try:
            while engine.has_unfinished_requests() and len(steady) < want:
                t = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t
                bar.update(1)
                st = engine.last_scheduler_stats
                if st.num_prefill_tokens or st.num_decode_tokens != bs:
                    continue
                parts = {"schedule": st.schedule_s, "prepare_inputs": st.prepare_s,
                         "device_step": st.device_s, "logits_transfer": st.transfer_s,
                         "sampling": st.sample_s, "update": st.update_s,
                         "detokenize": engine.last_output_processing_s}
                critical = st.host_critical_s
                # Async: set from the means below (a call's wall time and its step's device
                # time do not line up one to one; their means do).
                parts["other"] = (max(0.0, wall - sum(parts.values())) if critical is None
                                  else 0.0)
                steady.append(_StepRecord(wall, parts, critical, st.launch_s))
        finally:
            engine.abort_request(ids)
            bar.close()
        steady = steady[warmup_steps:]
        if not steady:
            results.append({"batch_size": bs, "skipped": "no steady-state decode step"})
            continue
        step_ms = 1e3 * float(np.mean([s.wall_s for s in steady]))
        critical_ms = _mean_ms([s.host_critical_s for s in steady])
        launch_ms = None if critical_ms is None else _mean_ms([s.launch_s for s in steady])
        phases = {}
        for name in PROFILE_PHASES:
            ms = 1e3 * float(np.mean([s.parts[name] for s in steady]))
            if name == "other" and critical_ms is not None:
                ms = max(0.0, step_ms - phases["device_step"]["ms"] - critical_ms)
            phases[name] = {"ms": ms, "percent": 100.0 * ms / max(step_ms, 1e-12)}
        host_ms = step_ms - phases["device_step"]["ms"]
        results.append({"batch_size": bs, "input_len": input_len, "steps": len(steady),
                        "sampling": sampling,
                        "step_ms": step_ms, "host_ms": host_ms, "host_critical_ms": critical_ms,
                        "launch_ms": launch_ms,
                        "async_scheduling": critical_ms is not None,
                        "host_percent": 100.0 * host_ms / max(step_ms, 1e-12),
                        "decode_tokens_per_second": bs * 1e3 / max(step_ms, 1e-12),
                        "phases": phases})
    return results


def print_profile(results: list[dict[str, Any]]) -> None:
    done = [r for r in results if "phases" in r]
    for r in results:
        if "skipped" in r:
            print(f"profile batch {r['batch_size']}: skipped ({r['skipped']})")
    if not done:
        return
    print("Step profile: host time per decode step (every request decoding), mean ms and % "
          "of the step")
    head = f"{'phase':<16}" + "".join(f"{'batch ' + str(r['batch_size']):>20}" for r in done)
    print(head)
    overlapped = any(r["async_scheduling"] for r in done)
    for name in PROFILE_PHASES:
        label = name + ("*" if overlapped and name in OVERLAPPED_PHASES else "")
        print(f"{label:<16}" + "".join(
            f"{r['phases'][name]['ms']:>11.2f} ms {r['phases'][name]['percent']:>5.1f}%"
            for r in done))
    if overlapped:
        for key, label in (("host_critical_ms", "host_critical"), ("launch_ms", "launch call")):
            print(f"{label:<16}" + "".join(
                f"{r[key]:>11.2f} ms {100 * r[key] / r['step_ms']:>5.1f}%"
                if r[key] is not None else f"{'-':>20}" for r in done))
    print(f"{'step':<16}" + "".join(f"{r['step_ms']:>11.2f} ms {100.0:>5.1f}%" for r in done))
    print(f"{'host (non-dev)':<16}" + "".join(
        f"{r['host_ms']:>11.2f} ms {r['host_percent']:>5.1f}%" for r in done))
    print(f"{'decode tok/s':<16}" + "".join(
        f"{r['decode_tokens_per_second']:>20.1f}" for r in done))
    if overlapped:
        print("async scheduling: step = device_step + host_critical (the device's idle gap: "
              "candidates on the host -> next dispatch) + other (host work the device did not "
              "hide); * marks phases that overlap the device step; logits_transfer and "
              "sampling lie inside host_critical; launch call: the call that starts the next "
              "step, from its start (where host_critical ends) to its return (on CPU the "
              "started step takes the cores from the caller at once)")


def maybe_profile(args: argparse.Namespace, llm: LLM, sampler: TokenSampler,
                  result: dict[str, Any]) -> None:
    """With --profile, run `profile_steps` after the benchmark and print its table."""
    if not args.profile:
        return
    prof = profile_steps(llm, sampler, args.profile_batch_sizes, args.profile_input_len,
                         args.profile_steps, seed=args.seed + 1, use_tqdm=not args.no_progress,
                         sampling=args.profile_sampling)
    result["profile"] = prof
    print_profile(prof)


def _mean_ms(seconds: list[float | None]) -> float | None:
    """Mean in milliseconds, or None when any step did not record the time."""
    known = [s for s in seconds if s is not None]
    return 1e3 * float(np.mean(known)) if len(known) == len(seconds) else None
