"""`jaxllm bench sweep`: output tokens/s against batch size (jaxllm, HF, the roofline), as JSON
and a plot."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from jaxllm.benchmarks.common import (
    args_dict,
    check_fits,
    finish,
    machine_for,
    make_hf_runner,
    make_llm,
    warm_up,
)
from jaxllm.benchmarks.datasets import synthetic_workload, token_sampler_for
from jaxllm.benchmarks.roofline import ModelCost, roofline, workload_cost
from jaxllm.benchmarks.throughput import run_jaxllm_throughput


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.output_png and importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--output-png needs matplotlib (pip install matplotlib)")
    sizes = sorted(set(args.batch_sizes))
    llm = make_llm(args, args.max_num_seqs or max(sizes))
    engine = llm.llm_engine
    sampler = token_sampler_for(llm)
    machine = machine_for(args, llm)
    cost = ModelCost.from_llm(llm)
    hf_runner = make_hf_runner(args, llm) if args.compare_hf else None
    warm_up(llm, sampler)
    rows = []
    for bs in sizes:
        workload = synthetic_workload(sampler, bs, args.input_len, args.output_len,
                                      args.seed + bs)
        check_fits(llm, workload)
        ours = run_jaxllm_throughput(llm, workload, True, use_tqdm=not args.no_progress)
        row: dict[str, Any] = {"batch_size": bs, "jaxllm": ours}
        measured = {"jaxllm": ours["elapsed_time"]}
        if hf_runner is not None:
            row["hf"] = hf_runner.throughput(workload, bs, True, use_tqdm=not args.no_progress)
            measured["hf"] = row["hf"]["elapsed_time"]
        if machine is not None:
            work = workload_cost(cost, workload.prompt_lens, workload.output_lens,
                                 min(bs, engine.engine_args.max_num_seqs),
                                 engine.engine_args.max_num_batched_tokens)
            row["roofline"] = roofline(machine, work, measured)
            row["roofline_output_tokens_per_second"] = (
                sum(workload.output_lens) / row["roofline"]["ideal_time_s"])
        rows.append(row)
        line = f"batch {bs}: jaxllm {ours['output_tokens_per_second']:.1f} output tok/s"
        if "hf" in row:
            line += f", HF {row['hf']['output_tokens_per_second']:.1f}"
        if "roofline" in row:
            line += (f", roofline {row['roofline_output_tokens_per_second']:.1f} "
                     f"({row['roofline']['jaxllm_fraction'] * 100:.1f}% reached)")
        print(line)
    result = {"command": "sweep", "engine": engine.describe(), "args": args_dict(args),
              "machine": machine, "rows": rows}
    if args.output_png:
        plot_sweep(rows, args.output_png,
                   f"{Path(engine.model_name).name}, {engine.describe()['dtype']}, "
                   f"input {args.input_len} / "
                   f"output {args.output_len}")
        print(f"plot written to {args.output_png}")
    finish(args, result)
    return 0


def plot_sweep(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["jaxllm"]["output_tokens_per_second"] for r in rows], "o-", label="jaxllm")
    if all("hf" in r for r in rows):
        ax.plot(xs, [r["hf"]["output_tokens_per_second"] for r in rows], "s-",
                label="HF transformers")
    if all("roofline" in r for r in rows):
        ax.plot(xs, [r["roofline_output_tokens_per_second"] for r in rows], "k--",
                label="roofline (ideal)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

