"""A `jax.profiler` trace of steady decode steps, summarised to JSON: kernels per step, how busy
the device was, the longest kernels, and the host's CUDA API calls per step (kernel launches,
graph launches, graph updates and instantiations, copies), which tell whether XLA's command
buffers replay a recorded graph or launch every kernel from the host.

The parser walks an XSpace's planes, lines and events without knowing a backend: on a GPU the
kernels are the events of the device plane's stream lines (`/device:GPU:0`) and the API calls
the host planes' `cu*` events (`/host:CUPTI`); on CPU, where no device plane exists, the
kernels are the host events that carry an `hlo_op` stat (XLA's CPU thunks)."""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

# Host-side CUDA API calls the command-buffer question turns on, by the pattern of their names
# (driver `cu*` and runtime `cuda*` spellings, any version suffix).
API_GROUPS: dict[str, re.Pattern[str]] = {
    "launch_kernel": re.compile(r"^cu(da)?LaunchKernel"),
    "graph_launch": re.compile(r"^cu(da)?GraphLaunch"),
    "graph_update": re.compile(r"^cu(da)?Graph(Exec\w*Update|Exec\w*SetParams|\w*NodeSetParams)"),
    "graph_instantiate": re.compile(r"^cu(da)?GraphInstantiate"),
    "memcpy": re.compile(r"^cu(da)?Memcpy", re.IGNORECASE),
}
API_NAME = re.compile(r"^cu[A-Z]|^cuda[A-Z]")
# The Python tracer's events (`file.py:12 fn`, `$builtins ...`): the host's runtime events are
# what the summary ranks.
PYTHON_EVENT = re.compile(r"\.py[:\s]|^\$|^<")
# Lines the profiler derives from others (TensorBoard's converter adds them): counting them
# would count each kernel twice.
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework", "Source", "Launch Stats")


def _stats(event: Any) -> dict[str, Any]:
    return {str(k): v for k, v in event.stats}


def _busy_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: streams running at once count once."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def _device_events(planes: list[Any]) -> tuple[str, list[tuple[Any, dict[str, Any]]]]:
    """The kernels and copies of the first device plane with any, else the host's XLA op
    events; with where they came from."""
    for plane in planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = [ln for ln in plane.lines if not ln.name.startswith(DERIVED_LINES)]
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        events = [(e, _stats(e)) for ln in (streams or lines) for e in ln.events]
        if events:
            return f"{plane.name} ({'stream' if streams else 'all'} lines)", events
    events = [(e, st) for plane in planes if plane.name.startswith("/host:")
              for ln in plane.lines for e in ln.events
              for st in (_stats(e),) if "hlo_op" in st]
    return "host events with an hlo_op stat (no device plane)", events


def summarize_xspace(profile: Any, steps: int, top: int = 10, top_host: int = 30
                     ) -> dict[str, Any]:
    """Per-step numbers from a jax.profiler.ProfileData of `steps` traced steps."""
    planes = list(profile.planes)
    source, events = _device_events(planes)
    kernels = [(e, st) for e, st in events
               if not re.search(r"memcpy|memset", e.name, re.IGNORECASE)
               and "memcpy_details" not in st and "memset_details" not in st]
    copies = len(events) - len(kernels)
    intervals = [(e.start_ns, e.start_ns + e.duration_ns) for e, _ in events]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0
    busy = _busy_ns(intervals)
    per_name: dict[str, list[float]] = {}
    for e, _ in kernels:
        per_name.setdefault(e.name, []).append(e.duration_ns)
    longest = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    # Kernels a CUDA graph launched carry its id in their stats (CUPTI's graph_id).
    graph_kernels = sum(1 for _, st in kernels
                        if any("graph" in k.lower() and v not in (0, "0", None, "")
                               for k, v in st.items()))
    api: Counter[str] = Counter()
    command_buffer: Counter[str] = Counter()
    host_ns: Counter[str] = Counter()
    host_count: Counter[str] = Counter()
    for plane in planes:
        if not plane.name.startswith("/host:"):
            continue
        for ln in plane.lines:
            for e in ln.events:
                if API_NAME.match(e.name):
                    api[e.name] += 1
                elif "commandbuffer" in e.name.lower().replace("_", "").replace(" ", ""):
                    command_buffer[e.name] += 1
                if not PYTHON_EVENT.search(e.name):
                    host_ns[e.name] += e.duration_ns
                    host_count[e.name] += 1
    groups = {g: sum(n for name, n in api.items() if pat.match(name))
              for g, pat in API_GROUPS.items()}
    n = max(steps, 1)
    return {
        "steps": steps, "kernel_source": source, "planes": [p.name for p in planes],
        "kernels": len(kernels), "kernels_per_step": len(kernels) / n,
        "copies_per_step": copies / n, "graph_launched_kernels_per_step": graph_kernels / n,
        "device_busy_us": busy / 1e3, "device_span_us": span / 1e3,
        "device_busy_percent": 100.0 * busy / span if span else None,
        "device_busy_us_per_step": busy / 1e3 / n,
        "longest_kernels": [{"name": name[:200], "count": len(d), "total_us": sum(d) / 1e3,
                             "mean_us": sum(d) / len(d) / 1e3} for name, d in longest],
        "host_api_calls_per_step": {g: c / n for g, c in groups.items()},
        "host_api_calls_by_name_per_step": {k: v / n for k, v in api.most_common(25)},
        "command_buffer_events_per_step": {k[:200]: v / n
                                           for k, v in command_buffer.most_common(10)},
        # Where the host's time goes (the runtime's own trace events, nested ones counted in
        # their parents too): which part of calling a step costs what.
        "host_events_per_step": [{"name": k[:200], "count": host_count[k] / n,
                                  "us": v / 1e3 / n} for k, v in host_ns.most_common(top_host)],
    }


def summarize_trace_dir(trace_dir: Path, steps: int) -> dict[str, Any]:
    """The summary of the newest .xplane.pb under `trace_dir` (jax.profiler's layout)."""
    from jax.profiler import ProfileData

    files = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {trace_dir}")
    return {"xplane_bytes": files[-1].stat().st_size,
            **summarize_xspace(ProfileData.from_file(str(files[-1])), steps)}


def trace_decode_steps(llm: Any, batch_size: int, input_len: int, steps: int,
                       trace_dir: Path, warmup_steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """`batch_size` requests of `input_len` random tokens decoding; after `warmup_steps` steady
    steps (every request decoding, none prefilling) a trace of the next `steps` such steps."""
    import jax
    import numpy as np

    from jaxllm.benchmarks.common import sampling_params
    from jaxllm.benchmarks.datasets import token_sampler_for

    engine = llm.llm_engine
    sampler = token_sampler_for(llm)
    rng = np.random.default_rng(seed)
    room = engine.max_model_len - input_len
    if room < 2 + warmup_steps + steps:
        raise ValueError(f"max_model_len {engine.max_model_len} leaves {room} tokens after "
                         f"{input_len}; the trace needs {2 + warmup_steps + steps}")
    ids = [f"trace-{batch_size}-{i}-{time.monotonic_ns()}" for i in range(batch_size)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": sampler.sample(rng, input_len)},
                           sampling_params(room, True))
    steady = traced = 0
    tracing = False
    start = 0.0
    try:
        while engine.has_unfinished_requests() and traced < steps:
            if steady == warmup_steps and not tracing:
                jax.profiler.start_trace(str(trace_dir))
                tracing, start = True, time.perf_counter()
            engine.step()
            st = engine.last_scheduler_stats
            if not tracing:
                steady += not st.num_prefill_tokens and st.num_decode_tokens == batch_size
            else:
                # Counted whatever its kind, so the per-step numbers divide by the steps the
                # trace really holds.
                traced += 1
        wall = time.perf_counter() - start
    finally:
        if tracing:
            jax.profiler.stop_trace()
        engine.abort_request(ids)
    if not traced:
        raise RuntimeError(f"no steady decode step at batch {batch_size}")
    return {"batch_size": batch_size, "input_len": input_len,
            "wall_ms_per_step": 1e3 * wall / traced, **summarize_trace_dir(trace_dir, traced)}
