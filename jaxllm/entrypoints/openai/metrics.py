"""Prometheus metrics for `GET /metrics`, with vLLM's names under our prefix.

Three feeds: the core's SchedulerStats of every step (AsyncLLM's stat loggers: running and
waiting requests, KV usage, prefix-cache lookups, preemptions), the scheduler's state read at
scrape time (the gauges: no step runs once aborts have emptied the engine, so the last step's
numbers would stay), and each request as it ends in the server (prompt and generation tokens,
TTFT, TPOT, end-to-end latency, finish reason). Counting
tokens per served request makes the counters move by exactly what the responses report.
A registry per server, not prometheus_client's global one: several servers can live in one
process (tests) without clashing names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.engine import SchedulerStats
from jaxllm.outputs import RequestMetrics

PREFIX = "jaxllm:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the core's running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries since start.")
        self.preemptions = counter("num_preemptions", "Preempted sequences.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of served requests.")
        self.generation_tokens = counter("generation_tokens",
                                         "Generated tokens of served requests.")
        self.success = Counter(PREFIX + "request_success", "Requests that ended, by reason.",
                               ["model_name", "finished_reason"], registry=reg)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last output.",
                             _LATENCY_BUCKETS)
        # Speculative decoding (vLLM's spec_decode counters): acceptance rate = accepted /
        # draft tokens; mean accepted length = 1 + accepted / drafts.
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Requests x steps that verified draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.")
        self._queries = self._hits = 0

    def record_stats(self, stats: SchedulerStats) -> None:
        """A stat logger for AsyncLLM: called with every step's stats."""
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
            self._queries += stats.prefix_cache_queries
            self._hits += stats.prefix_cache_hits
            self.prefix_hit_rate.set(self._hits / self._queries)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        if stats.spec_num_drafts:
            self.spec_drafts.inc(stats.spec_num_drafts)
            self.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.spec_num_accepted_tokens)

    def record_scheduler_state(self, state: dict[str, int]) -> None:
        """The gauges as the core's `get_scheduler_state` reports them now."""
        self.running.set(state["num_running_reqs"])
        self.waiting.set(state["num_waiting_reqs"])
        usable = state["num_usable_blocks"]
        self.kv_usage.set(0.0 if usable <= 0 else 1.0 - state["num_free_blocks"] / usable)

    def record_engine_dead(self) -> None:
        """A dead core holds no requests and no blocks: the gauges say so rather than keep the
        values of its last step."""
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.set(0)

    def record_request(self, num_prompt: int, num_generated: int,
                       times: RequestMetrics | None, finish_reason: str | None,
                       num_sequences: int = 1) -> None:
        """`num_generated`: tokens of all `num_sequences` choices (n) together."""
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_generated)
        self.success.labels(self.model_name, finish_reason or "abort").inc()
        if times is None or times.first_token_time is None:
            return
        self.ttft.observe(max(times.first_token_time - times.arrival_time, 0.0))
        if times.finished_time is not None:
            self.e2e.observe(max(times.finished_time - times.arrival_time, 0.0))
            per_sequence = num_generated / max(num_sequences, 1)  # the choices decode together
            if per_sequence > 1:
                self.tpot.observe(max(times.finished_time - times.first_token_time, 0.0)
                                  / (per_sequence - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
