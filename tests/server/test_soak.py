"""A 30-second soak of the shared tiny-qwen2 server (benchmarks/serve_soak.py's ladder, up to
256 streams at once, driven by `jaxllm bench serve`): no request fails, the engine is at rest
afterwards (request gauges and KV usage 0), and the server's RSS after the last ladder is within
the bound of its RSS after the first (warm) one."""

from __future__ import annotations

import sys

from tests.server.conftest import HARDENED_KEY
from tests.server.openai_server import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_soak import problems, run_soak  # noqa: E402

RSS_GROWTH_BOUND_MIB = 256
# The benchmark holds /health to 1 s on a quiet machine; in the suite the 256-stream stages share
# 2 cores with everything else, so the bound here only catches a blocked event loop (the stalls
# of blocking work on it lasted 9-30 s).
HEALTH_STALL_BOUND_S = 5.0


def test_soak_30_seconds(hardened_server):
    report = run_soak(hardened_server.url, hardened_server.port, hardened_server.proc.pid,
                      duration_s=30, api_key=HARDENED_KEY)
    assert len(report["ladder_rss_mib"]) >= 2
    assert max(s["max_concurrency"] for s in report["stages"]) == 256
    done = sum(s["completed"] for s in report["stages"])
    assert done == sum(s["num_prompts"] for s in report["stages"])
    assert all(s["p99_ttft_ms"] > 0 for s in report["stages"])
    # Mixed constrained, tool and hostile requests beside the ladder: no 5xx, no /health stall.
    assert sum(sum(c.values()) for c in report["mixed"]["statuses"].values()) > 0
    assert problems(report, RSS_GROWTH_BOUND_MIB, HEALTH_STALL_BOUND_S) == []
    assert report["at_rest"] == {"jaxllm:num_requests_running": 0,
                                 "jaxllm:num_requests_waiting": 0,
                                 "jaxllm:kv_cache_usage_perc": 0}
