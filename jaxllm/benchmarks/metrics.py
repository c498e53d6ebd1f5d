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

