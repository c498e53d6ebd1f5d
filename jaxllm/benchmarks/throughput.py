"""`jaxllm bench throughput`: offline throughput of N requests (synthetic or from a dataset),
with the HF baseline, the roofline, the matmul floor and the step profile on request."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

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
from jaxllm.benchmarks.datasets import (
    Workload,
    load_dataset,
    read_records,
    synthetic_workload,
    token_sampler_for,
)
from jaxllm.benchmarks.matmul_floor import matmul_floor, print_matmul_floor, step_shape_counts
from jaxllm.benchmarks.metrics import (
    format_spec_decode,
    spec_decode_metrics,
    throughput_metrics,
)
from jaxllm.benchmarks.profile import maybe_profile
from jaxllm.benchmarks.roofline import ModelCost, print_roofline, roofline, workload_cost

if TYPE_CHECKING:
    from jaxllm import LLM


def run_jaxllm_throughput(llm: LLM, workload: Workload, ignore_eos: bool,
                          use_tqdm: bool = True) -> dict[str, Any]:
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [sampling_params(n, ignore_eos) for n in workload.output_lens]
    counters = scheduler_state(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {**throughput_metrics(elapsed, sum(workload.prompt_lens), out_tokens, len(workload)),
            **spec_decode_metrics(counters, scheduler_state(llm))}


def cmd_throughput(args: argparse.Namespace) -> int:
    if args.dataset is None and args.num_prompts is None:
        args.num_prompts = 64
    count = args.num_prompts
    if args.dataset is not None:
        count = len(read_records(args.dataset))
        count = min(count, args.num_prompts or count)
    need_seqs = min(count, 256)
    llm = make_llm(args, profile_max_seqs(args, need_seqs))
    engine = llm.llm_engine
    sampler = token_sampler_for(llm)
    if args.dataset is not None:
        workload = load_dataset(args.dataset, engine.tokenizer, args.output_len, args.num_prompts)
    else:
        workload = synthetic_workload(sampler, args.num_prompts, args.input_len, args.output_len,
                                      args.seed, args.random_input_range,
                                      args.random_output_range)
    check_fits(llm, workload)
    result: dict[str, Any] = {"command": "throughput", "engine": engine.describe(),
                              "workload": workload.summary(), "args": args_dict(args)}
    print(f"Workload: {workload.description} ({sum(workload.prompt_lens)} prompt, "
          f"{sum(workload.output_lens)} output tokens), ignore_eos={args.ignore_eos}")
    warm_up(llm, sampler)
    llm.collective_rpc("reset_step_shape_counts")
    ours = run_jaxllm_throughput(llm, workload, args.ignore_eos, use_tqdm=not args.no_progress)
    step_shapes = step_shape_counts(llm)
    result.update(ours)
    print(f"Throughput: {ours['requests_per_second']:.2f} requests/s, "
          f"{ours['total_tokens_per_second']:.1f} total tokens/s, "
          f"{ours['output_tokens_per_second']:.1f} output tokens/s "
          f"({ours['num_requests']} requests, {ours['total_prompt_tokens']} prompt + "
          f"{ours['total_output_tokens']} output tokens in {ours['elapsed_time']:.2f} s)")
    spec = format_spec_decode(ours)
    if spec is not None:
        print(spec)
    measured = {"jaxllm": ours["elapsed_time"]}
    if args.compare_hf:
        hf = make_hf_runner(args, llm).throughput(workload, args.hf_batch_size,
                                                  args.ignore_eos, use_tqdm=not args.no_progress)
        hf["speedup"] = ours["output_tokens_per_second"] / hf["output_tokens_per_second"]
        result["hf"] = hf
        result["speedup_vs_hf"] = hf["speedup"]
        measured["hf"] = hf["elapsed_time"]
        print(f"HF transformers (batch {hf['batch_size']}, {hf['dtype']}, {hf['device']}): "
              f"{hf['requests_per_second']:.2f} requests/s, "
              f"{hf['total_tokens_per_second']:.1f} total tokens/s, "
              f"{hf['output_tokens_per_second']:.1f} output tokens/s in "
              f"{hf['elapsed_time']:.2f} s -> jaxllm / HF output tok/s = {hf['speedup']:.2f}x")
    machine = machine_for(args, llm)
    if machine is not None:
        work = workload_cost(ModelCost.from_llm(llm), workload.prompt_lens,
                             workload.output_lens, engine.engine_args.max_num_seqs,
                             engine.engine_args.max_num_batched_tokens)
        result["roofline"] = roofline(machine, work, measured)
        print_roofline(result["roofline"])
        result["matmul_floor"] = matmul_floor(llm, step_shapes)
        print_matmul_floor(result["matmul_floor"], ours["elapsed_time"], "the run")
    maybe_profile(args, llm, sampler, result)
    finish(args, result)
    return 0

