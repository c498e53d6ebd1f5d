"""Prometheus metrics for `GET /metrics`, with vLLM's names under our prefix.

Three feeds: each engine core's SchedulerStats of every step (AsyncLLM's stat loggers: running
and waiting requests, KV usage, prefix-cache lookups, preemptions; labelled `engine`, the core's
index), the schedulers' state read at scrape time (the gauges: no step runs once aborts have
emptied the engine, so the last step's numbers would stay), and each request as it ends in the
server (prompt and generation tokens, TTFT, TPOT, end-to-end latency, finish reason). Counting
tokens per served request makes the counters move by exactly what the responses report.
A registry per server, not prometheus_client's global one: several servers can live in one
process (tests) without clashing names.
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.engine import SchedulerStats
from jaxllm.outputs import RequestMetrics

PREFIX = "jaxllm:"
_M = TypeVar("_M", Gauge, Counter)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, model_name: str, max_loras: int = 0) -> None:
        """`max_loras` > 0: the engine runs LoRA adapters, and `lora_requests_info` says which."""
        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.max_loras = max_loras

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=reg).labels(model_name)

        # What each engine core reports, labelled by its index as vLLM does (engine="0" with
        # one core); sum over `engine` for the whole server.
        engine_labels = ["model_name", "engine"]
        self._running = Gauge(PREFIX + "num_requests_running",
                              "Sequences in the core's running batch.", engine_labels,
                              registry=reg)
        self._waiting = Gauge(PREFIX + "num_requests_waiting",
                              "Sequences waiting to be scheduled.", engine_labels, registry=reg)
        self._kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                               "Fraction of the core's KV blocks in use (0-1).", engine_labels,
                               registry=reg)
        self._prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                       "Prompt tokens looked up in the prefix cache.",
                                       engine_labels, registry=reg)
        self._prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                    "Prompt tokens found in the prefix cache.", engine_labels,
                                    registry=reg)
        self._prefix_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate",
                                      "Prefix-cache hits / queries since start.", engine_labels,
                                      registry=reg)
        self._preemptions = Counter(PREFIX + "num_preemptions", "Preempted sequences.",
                                    engine_labels, registry=reg)
        # Data parallelism: what the frontend's client counts per core.
        self._routed = Gauge(PREFIX + "engine_requests_routed",
                             "Requests routed to this engine core since start.", engine_labels,
                             registry=reg)
        self._alive = Gauge(PREFIX + "engine_alive", "1 while this engine core lives, else 0.",
                            engine_labels, registry=reg)
        self._restarts = Counter(PREFIX + "engine_restarts",
                                 "Times this engine core's process was started again after it "
                                 "died.", engine_labels, registry=reg)
        self._restarts_seen: dict[int, int] = {}
        self.engines_alive = gauge("num_engines_alive", "Engine cores alive.")
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
        # vLLM's LoRA gauge: the adapters running and waiting (names, comma-separated) in its
        # labels, the time they were seen as its value; the newest series is the state now.
        self._lora_info = Gauge(PREFIX + "lora_requests_info",
                                "LoRA adapters of the running and waiting requests.",
                                ["model_name", "engine", "max_lora", "running_lora_adapters",
                                 "waiting_lora_adapters"], registry=reg) if max_loras else None
        self._queries: dict[int, int] = {}
        self._hits: dict[int, int] = {}

    def _engine(self, metric: _M, engine_index: int) -> _M:
        return metric.labels(self.model_name, str(engine_index))

    def record_stats(self, stats: SchedulerStats) -> None:
        """A stat logger for AsyncLLM: called with every step's stats (of the core
        `stats.engine_index`)."""
        i = stats.engine_index
        self._engine(self._running, i).set(stats.num_running_reqs)
        self._engine(self._waiting, i).set(stats.num_waiting_reqs)
        self._engine(self._kv_usage, i).set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            self._engine(self._prefix_queries, i).inc(stats.prefix_cache_queries)
            self._engine(self._prefix_hits, i).inc(stats.prefix_cache_hits)
            self._queries[i] = self._queries.get(i, 0) + stats.prefix_cache_queries
            self._hits[i] = self._hits.get(i, 0) + stats.prefix_cache_hits
            self._engine(self._prefix_hit_rate, i).set(self._hits[i] / self._queries[i])
        if stats.num_preemptions:
            self._engine(self._preemptions, i).inc(stats.num_preemptions)
        if self._lora_info is not None:
            self._lora_info.labels(self.model_name, str(i), str(self.max_loras),
                                   ",".join(sorted(stats.running_lora_adapters)),
                                   ",".join(sorted(stats.waiting_lora_adapters))
                                   ).set_to_current_time()
        if stats.spec_num_drafts:
            self.spec_drafts.inc(stats.spec_num_drafts)
            self.spec_draft_tokens.inc(stats.spec_num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.spec_num_accepted_tokens)

    def record_scheduler_state(self, state: dict[str, int], engine_index: int = 0) -> None:
        """The gauges as the core's `get_scheduler_state` reports them now."""
        self._engine(self._running, engine_index).set(state["num_running_reqs"])
        self._engine(self._waiting, engine_index).set(state["num_waiting_reqs"])
        usable = state["num_usable_blocks"]
        self._engine(self._kv_usage, engine_index).set(
            0.0 if usable <= 0 else 1.0 - state["num_free_blocks"] / usable)

    def record_engine_dead(self, engine_index: int = 0) -> None:
        """A dead core holds no requests and no blocks: the gauges say so rather than keep the
        values of its last step."""
        for gauge in (self._running, self._waiting, self._kv_usage):
            self._engine(gauge, engine_index).set(0)

    def record_engines(self, engines: list[tuple[int, bool, int, int]]) -> None:
        """Data parallelism: each core's (index, alive, requests routed to it, restarts)."""
        for i, alive, routed, restarts in engines:
            self._engine(self._alive, i).set(int(alive))
            self._engine(self._routed, i).set(routed)
            # The client counts; the counter catches up with it.
            self._engine(self._restarts, i).inc(restarts - self._restarts_seen.get(i, 0))
            self._restarts_seen[i] = restarts
        self.engines_alive.set(sum(alive for _, alive, *_ in engines))

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
