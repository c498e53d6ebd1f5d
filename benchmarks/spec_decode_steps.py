"""Where a speculative step's time goes on the embedded model, batch 1: the weight matmuls at
1 + k rows against 1 row (`time_weight_matmuls`, the runner's own weights and kernels), and the
engine's median step time per step shape while it decodes a code-edit prompt with n-gram drafts
of k tokens, with the drafts accepted per step. Together they bound the speed-up at batch 1:
(1 + mean accepted drafts) x decode step / spec step.

The matmuls' rate (GFLOP/s: 2 x rows x decoder weights + 2 x logits rows x LM head) is set
against the machine's float32 GEMM rate (numpy's 2048^3 matmul): where a 1 + k row step's
rate nears it, verifying k drafts costs compute, not just the one read of the weights. The
engine gets max_num_seqs 16 so that the timed matmuls compute logits at every row, as a spec
step does (batch 1 still runs the one-sequence buckets).

    PYTHONPATH=. .venv/bin/python benchmarks/spec_decode_steps.py --ks 3 5 8
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.benchmarks.common import scheduler_state

ROOT = Path(__file__).resolve().parent
PROMPTS = ROOT / "data" / "code_edit_prompts.json"


def step_times(llm: LLM, messages: list[dict], max_tokens: int) -> dict[str, list[float]]:
    """Device seconds of each step by shape (num_tokens, max_query_len), one greedy chat."""
    core = llm.llm_engine.engine_core_client.engine_core
    times: dict[str, list[float]] = defaultdict(list)
    original = core.step

    def step():
        out = original()
        stats = out.scheduler_stats
        if stats is not None and stats.step_shape is not None:
            times[str(tuple(stats.step_shape))].append(stats.device_s)
        return out

    core.step = step
    try:
        llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                 use_tqdm=False)
    finally:
        core.step = original
    return times


def sgemm_gflops(n: int = 2048, reps: int = 5) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 5, 8])
    ap.add_argument("--prompt", type=int, default=0, help="index into the code-edit prompts")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "spec_decode_steps.json")
    args = ap.parse_args()
    messages = json.loads(PROMPTS.read_text())[args.prompt]["messages"]
    report: dict = {"sgemm_2048_gflops": sgemm_gflops(), "matmuls_s": {},
                    "matmuls_gflops": {}, "steps": {}}
    for k in args.ks:
        llm = LLM(max_num_seqs=16, show_progress=False, speculative_config={
            "method": "ngram", "num_speculative_tokens": k})
        if not report["matmuls_s"]:
            rows = sorted({1, *(1 + k for k in args.ks)})
            w = llm.collective_rpc("get_weight_stats")
            for n, t in llm.collective_rpc("time_weight_matmuls", (rows, 5)).items():
                n = int(n)
                flops = 2 * n * (w["body_params"] + w["head_params"])
                report["matmuls_s"][str(n)] = t
                report["matmuls_gflops"][str(n)] = flops / t / 1e9
        step_times(llm, messages, 8)  # first calls, the prompt's blocks cached
        before = scheduler_state(llm)
        start = time.perf_counter()
        times = step_times(llm, messages, args.max_tokens)
        elapsed = time.perf_counter() - start
        after = scheduler_state(llm)
        drafts = after["num_spec_drafts"] - before["num_spec_drafts"]
        accepted = after["num_spec_accepted_tokens"] - before["num_spec_accepted_tokens"]
        median = {shape: float(np.median(v)) * 1e3 for shape, v in times.items()}
        mean_len = 1 + accepted / max(drafts, 1)
        decode, spec = median.get(str((1, 1))), median.get(str((1 + k, 1 + k)))
        report["steps"][k] = {
            "median_device_ms": median, "steps": {shape: len(v) for shape, v in times.items()},
            "mean_accepted_length": mean_len, "elapsed_s": elapsed,
            "spec_over_decode_step": spec / decode if decode and spec else None,
            "speedup_bound": mean_len * decode / spec if decode and spec else None}
        del llm
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
