"""`jaxllm bench latency`: end-to-end latency, TTFT and TPOT of one batch over several
iterations, with the HF baseline, the roofline, the matmul floor, decode against the memory bound
and the step profile on request."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from jaxllm.benchmarks.common import (
    args_dict,
    check_fits,
    finish,
    machine_for,
    make_hf_runner,
    make_llm,
    profile_max_seqs,
    sampling_params,
    scheduler_state,
    warm_up,
)
from jaxllm.benchmarks.datasets import TokenSampler, Workload, token_sampler_for
from jaxllm.benchmarks.matmul_floor import (
    decode_vs_bound,
    matmul_floor,
    print_decode_vs_bound,
    print_matmul_floor,
    step_shape_counts,
)
from jaxllm.benchmarks.metrics import format_spec_decode, latency_metrics, spec_decode_metrics
from jaxllm.benchmarks.profile import maybe_profile
from jaxllm.benchmarks.roofline import ModelCost, print_roofline, roofline, workload_cost

if TYPE_CHECKING:
    from jaxllm import LLM


def run_jaxllm_latency(llm: LLM, sampler: TokenSampler, batch_size: int, input_len: int,
                       output_len: int, num_iters: int, num_iters_warmup: int, seed: int,
                       use_tqdm: bool = True) -> dict[str, Any]:
    """Each iteration sends a fresh batch (so the prefix cache cannot skip prefills)."""
    rng = np.random.default_rng(seed)
    sp = sampling_params(output_len, True)

    def batch():
        return [{"prompt_token_ids": sampler.sample(rng, input_len)} for _ in range(batch_size)]

    for _ in tqdm(range(num_iters_warmup), desc="Warm-up iterations", disable=not use_tqdm):
        llm.generate(batch(), sp, use_tqdm=False)
    # Only measured iterations count toward the run's step shapes (the matmul floor).
    llm.collective_rpc("reset_step_shape_counts")
    counters = scheduler_state(llm)
    latencies, ttfts, tpots = [], [], []
    out_tokens = 0
    for _ in tqdm(range(num_iters), desc="Measured iterations", disable=not use_tqdm):
        prompts = batch()
        start = time.perf_counter()
        outputs = llm.generate(prompts, sp, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
        for o in outputs:
            m = o.metrics
            n = len(o.outputs[0].token_ids)
            out_tokens += n
            if m is None or m.first_token_time is None:
                continue
            ttfts.append(m.first_token_time - m.arrival_time)
            if n > 1 and m.finished_time is not None:
                tpots.append((m.finished_time - m.first_token_time) / (n - 1))
    return {**latency_metrics(latencies, ttfts, tpots, out_tokens),
            **spec_decode_metrics(counters, scheduler_state(llm))}


def cmd_latency(args: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    llm = make_llm(args, profile_max_seqs(args, args.batch_size))
    engine = llm.llm_engine
    if args.batch_size > engine.engine_args.max_num_seqs:
        print(f"warning: --batch-size {args.batch_size} > max_num_seqs "
              f"{engine.engine_args.max_num_seqs}: requests queue", file=sys.stderr)
    sampler = token_sampler_for(llm)
    workload = Workload([[0] * args.input_len] * args.batch_size,
                        [args.output_len] * args.batch_size,
                        f"batch {args.batch_size}, input {args.input_len}, "
                        f"output {args.output_len}")
    check_fits(llm, workload)
    result: dict[str, Any] = {"command": "latency", "engine": engine.describe(),
                              "workload": workload.summary(), "args": args_dict(args)}
    print(f"Workload: {workload.description}, {args.num_iters} iterations "
          f"(+{args.num_iters_warmup} warm-up), ignore_eos=True")
    warm_up(llm, sampler)
    ours = run_jaxllm_latency(llm, sampler, args.batch_size, args.input_len, args.output_len,
                              args.num_iters, args.num_iters_warmup, args.seed,
                              use_tqdm=not args.no_progress)
    result.update(ours)
    _print_latency("jaxllm", ours)
    measured = {"jaxllm": ours["latency_mean"]}
    if args.compare_hf:
        hf = make_hf_runner(args, llm).latency(sampler, args.batch_size, args.input_len,
                                               args.output_len, args.num_iters,
                                               args.num_iters_warmup, args.seed,
                                               use_tqdm=not args.no_progress)
        hf["speedup"] = hf["latency_mean"] / ours["latency_mean"]
        result["hf"] = hf
        result["speedup_vs_hf"] = hf["speedup"]
        measured["hf"] = hf["latency_mean"]
        _print_latency(f"HF transformers ({hf['dtype']}, {hf['device']})", hf)
        print(f"HF / jaxllm mean latency = {hf['speedup']:.2f}x")
    machine = machine_for(args, llm)
    if machine is not None:
        work = workload_cost(ModelCost.from_llm(llm), workload.prompt_lens, workload.output_lens,
                             args.batch_size, engine.engine_args.max_num_batched_tokens)
        result["roofline"] = roofline(machine, work, measured)
        print_roofline(result["roofline"])
        floor = matmul_floor(llm, step_shape_counts(llm))
        result["matmul_floor"] = floor
        print_matmul_floor(floor, sum(ours["latencies"]),
                           f"the {args.num_iters} measured iterations")
        result["decode"] = decode_vs_bound(floor, result["roofline"], ours.get("tpot_mean"),
                                           result.get("hf", {}).get("tpot_mean"))
        print_decode_vs_bound(result["decode"])
    maybe_profile(args, llm, sampler, result)
    finish(args, result)
    return 0


def _print_latency(name: str, m: dict[str, Any]) -> None:
    print(f"{name}: latency mean {m['latency_mean']:.3f} s, p50 {m['latency_p50']:.3f} s, "
          f"p99 {m['latency_p99']:.3f} s; TTFT mean {m['ttft_mean'] * 1e3:.1f} ms, "
          f"p50 {m['ttft_p50'] * 1e3:.1f} ms, p99 {m['ttft_p99'] * 1e3:.1f} ms; "
          f"TPOT mean {m.get('tpot_mean', float('nan')) * 1e3:.1f} ms, "
          f"p50 {m.get('tpot_p50', float('nan')) * 1e3:.1f} ms, "
          f"p99 {m.get('tpot_p99', float('nan')) * 1e3:.1f} ms; "
          f"{m['output_tokens_per_second']:.1f} output tok/s")
    spec = format_spec_decode(m)
    if spec is not None:
        print(spec)

