"""The metrics a throughput or latency run reports (jaxllm and the HF baseline alike)."""

from __future__ import annotations

from typing import Any

import numpy as np


def throughput_metrics(elapsed: float, prompt_tokens: int, output_tokens: int,
                       num_requests: int) -> dict[str, float]:
    elapsed = max(elapsed, 1e-9)
    return {"elapsed_time": elapsed, "num_requests": num_requests,
            "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "total_num_tokens": prompt_tokens + output_tokens,
            "requests_per_second": num_requests / elapsed,
            "output_tokens_per_second": output_tokens / elapsed,
            "total_tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            # vLLM's name for the total rate
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed}



def _stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, np.float64)
    return {f"{prefix}_mean": float(arr.mean()), f"{prefix}_p50": float(np.percentile(arr, 50)),
            f"{prefix}_p99": float(np.percentile(arr, 99))}


def latency_metrics(latencies: list[float], ttfts: list[float], tpots: list[float],
                    output_tokens: int) -> dict[str, Any]:
    out = {"avg_latency": float(np.mean(latencies)), "latencies": [float(x) for x in latencies],
           **_stats(latencies, "latency"), **_stats(ttfts, "ttft"), **_stats(tpots, "tpot")}
    out["output_tokens_per_second"] = output_tokens / max(sum(latencies), 1e-9)
    return out


# The core's cumulative speculative-decoding counters (get_scheduler_state).
SPEC_DECODE_COUNTERS = ("num_spec_drafts", "num_spec_draft_tokens", "num_spec_accepted_tokens")


def spec_decode_metrics(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """Speculative decoding over a run, from the core's counters before and after it, with vLLM's
    definitions: acceptance rate = accepted / draft tokens, mean accepted length = 1 + accepted /
    drafts (the tokens one request gains from a step that carried drafts). Empty when no step
    carried draft tokens (speculation off, or nothing in the run to look up)."""
    drafts, draft_tokens, accepted = (int(after.get(k, 0)) - int(before.get(k, 0))
                                      for k in SPEC_DECODE_COUNTERS)
    if drafts <= 0 or draft_tokens <= 0:
        return {}
    return {"spec_decode_acceptance_rate": accepted / draft_tokens,
            "spec_decode_mean_accepted_length": 1 + accepted / drafts,
            "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted}


def format_spec_decode(m: dict[str, float]) -> str | None:
    """The one-line summary of spec_decode_metrics' keys in `m`, None when it has none."""
    if "spec_decode_num_drafts" not in m:
        return None
    return (f"Speculative decoding: acceptance rate {m['spec_decode_acceptance_rate']:.1%}, "
            f"mean accepted length {m['spec_decode_mean_accepted_length']:.2f} "
            f"({m['spec_decode_num_drafts']} drafts, {m['spec_decode_num_draft_tokens']} draft "
            f"tokens, {m['spec_decode_num_accepted_tokens']} accepted)")
