"""Bounded load and soak of `jaxllm serve tiny-qwen2`, driven by `jaxllm bench serve`.

A ladder of stages at rising request rates and concurrency (up to 256 streams) runs again and
again for a fixed time. It holds when no request fails, the server is at rest afterwards (KV
blocks and request gauges back to 0), and the server's RSS (its whole process tree) grew by less
than the bound between the end of the first ladder (every batch shape compiled, caches warm) and
the end of the last one. p99 TTFT is recorded per stage.

Beside the ladder, mixed traffic runs throughout: constrained completions (a JSON schema, a
regex, a choice, a grammar too deep for llguidance, a schema too deep for the server), chat
requests whose tool_choice forces calls, and requests with many stop strings, while `/health`
is polled. It holds when none of them gets a 5xx (the hostile ones get their 400s) and no
`/health` answer took longer than the stall bound (1 s).

    python benchmarks/serve_soak.py [--duration-s 180] [--rss-growth-bound-mib 256]
                                    [--output-json benchmarks/results/serve_soak.json]

It starts its own server on a free loopback port; `run_soak` drives one that is already up
(tests/server/test_soak.py runs a 30-second version in the suite).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Stage:
    request_rate: float  # requests per second (Poisson arrivals); inf: all at once
    max_concurrency: int
    num_prompts: int


# Rising load, ending with 256 streams at once.
LADDER = (Stage(4.0, 16, 16), Stage(16.0, 64, 48), Stage(64.0, 128, 128),
          Stage(float("inf"), 256, 256))
SOAK_SERVER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "64",
                    "--max-num-batched-tokens", "512", "--num-kv-blocks", "2048")


def process_tree_rss_mib(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / (1 << 20)


def scrape(url: str, name: str) -> float:
    """The sum of a /metrics sample over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    pat = re.compile(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", re.M)
    return sum(float(v) for v in pat.findall(text))


def at_rest(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The request and KV gauges once they are all 0, or as they are after `timeout_s`."""
    names = ("jaxllm:num_requests_running", "jaxllm:num_requests_waiting",
             "jaxllm:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout_s
    while True:
        values = {n: scrape(url, n) for n in names}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def run_stage(port: int, api_key: str | None, stage: Stage, input_len: int, output_len: int,
              seed: int, out_dir: Path) -> dict[str, Any]:
    from jaxllm.entrypoints.cli.main import main

    out = out_dir / f"stage_{seed}.json"
    argv = ["bench", "serve", "--port", str(port), "--num-prompts", str(stage.num_prompts),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--request-rate", str(stage.request_rate),
            "--max-concurrency", str(stage.max_concurrency), "--seed", str(seed),
            "--disable-tqdm", "--output-json", str(out)]
    if api_key:
        argv += ["--api-key", api_key]
    main(argv)
    return json.loads(out.read_text())


def _post(url: str, path: str, body: dict[str, Any], api_key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _mixed_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(what, path, body) of the side traffic: constrained, tool and hostile requests."""
    deep = ("start: r0\n" + "\n".join(f'r{i}: "t{i}" r{i + 1} | "u{i}"' for i in range(3000))
            + '\nr3000: "z"')
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(1000)}
    defs["d1000"] = {"type": "string"}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    c = {"model": "tiny-qwen2", "prompt": "x", "max_tokens": 8, "temperature": 1.0}
    return [
        ("json schema", "/v1/completions", {**c, "guided_json": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}),
        ("regex", "/v1/completions", {**c, "guided_regex": "[a-z]{1,6}"}),
        ("choice", "/v1/completions", {**c, "guided_choice": ["yes", "no"]}),
        ("deep grammar", "/v1/completions", {**c, "guided_grammar": deep}),
        ("deep $ref schema", "/v1/completions", {**c, "guided_json": {
            "$ref": "#/$defs/d0", "$defs": defs}}),
        ("many stop strings", "/v1/completions", {**c, "n": 4, "stop": [
            f"never-{i}" for i in range(64)]}),
        ("tool_choice required", "/v1/chat/completions", {
            "model": "tiny-qwen2", "messages": ask, "tools": [weather], "max_tokens": 40,
            "tool_choice": "required"}),
        ("tool_choice named", "/v1/chat/completions", {
            "model": "tiny-qwen2", "messages": ask, "tools": [weather], "max_tokens": 40,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ("plain", "/v1/completions", c),
    ]


class MixedTraffic:
    """The side traffic and the /health poller, on threads, until `stop()`."""

    def __init__(self, url: str, api_key: str | None) -> None:
        import threading

        self.url, self.api_key = url, api_key
        self.statuses: dict[str, dict[int, int]] = {}
        self.health_max_s = 0.0
        self.health_failures = 0
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._send, daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]
        for t in self._threads:
            t.start()

    def _send(self) -> None:
        requests = _mixed_requests()
        i = 0
        while not self._done.is_set():
            what, path, body = requests[i % len(requests)]
            i += 1
            try:
                status = _post(self.url, path, body, self.api_key)
            except OSError:
                status = 0  # no answer at all
            counts = self.statuses.setdefault(what, {})
            counts[status] = counts.get(status, 0) + 1

    def _poll(self) -> None:
        while not self._done.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=30) as r:
                    ok = r.status == 200
            except OSError:
                ok = False
            self.health_max_s = max(self.health_max_s, time.monotonic() - start)
            self.health_failures += not ok
            time.sleep(0.05)

    def stop(self) -> dict[str, Any]:
        self._done.set()
        for t in self._threads:
            t.join(timeout=150)
        return {"statuses": {k: {str(s): n for s, n in v.items()}
                             for k, v in self.statuses.items()},
                "health_max_s": self.health_max_s, "health_failures": self.health_failures}


def run_soak(url: str, port: int, server_pid: int, duration_s: float,
             api_key: str | None = None, ladder: tuple[Stage, ...] = LADDER,
             input_len: int = 32, output_len: int = 16) -> dict[str, Any]:
    """The ladder again and again until `duration_s` has passed (at least twice: the first
    ladder warms up), with the mixed traffic beside it; per stage, bench serve's summary and
    the RSS after it."""
    stages: list[dict[str, Any]] = []
    ladder_rss: list[float] = []
    start = time.monotonic()
    seed = 0
    mixed = MixedTraffic(url, api_key)
    with tempfile.TemporaryDirectory() as tmp:
        while len(ladder_rss) < 2 or time.monotonic() - start < duration_s:
            for stage in ladder:
                m = run_stage(port, api_key, stage, input_len, output_len, seed, Path(tmp))
                seed += 1
                stages.append({**asdict(stage), "ladder": len(ladder_rss),
                               "completed": m["completed"], "failed": m["failed"],
                               "errors": m["errors"], "p99_ttft_ms": m["p99_ttft_ms"],
                               "median_ttft_ms": m["median_ttft_ms"],
                               "output_throughput": m["output_throughput"],
                               "duration_s": m["duration_s"],
                               "rss_mib": process_tree_rss_mib(server_pid)})
            ladder_rss.append(process_tree_rss_mib(server_pid))
    return {"duration_s": time.monotonic() - start, "input_len": input_len,
            "output_len": output_len, "stages": stages, "ladder_rss_mib": ladder_rss,
            "rss_growth_mib": ladder_rss[-1] - ladder_rss[0], "mixed": mixed.stop(),
            "at_rest": at_rest(url)}


# The longest a /health answer may take while the soak runs.
HEALTH_STALL_BOUND_S = 1.0
# What each kind of side request must get (anything else, a 5xx above all, is a problem).
_MIXED_EXPECTED = {"deep grammar": {"400"}, "deep $ref schema": {"400"}}


def problems(report: dict[str, Any], rss_growth_bound_mib: float,
             health_stall_bound_s: float = HEALTH_STALL_BOUND_S) -> list[str]:
    """What the soak found wrong; empty when it held."""
    out = [f"stage {s['request_rate']} req/s x {s['max_concurrency']}: {s['failed']} failed "
           f"({s['errors']})" for s in report["stages"] if s["failed"]]
    mixed = report["mixed"]
    for what, counts in mixed["statuses"].items():
        bad = set(counts) - _MIXED_EXPECTED.get(what, {"200"})
        if bad:
            out.append(f"{what}: statuses {counts}")
    if mixed["health_max_s"] > health_stall_bound_s or mixed["health_failures"]:
        out.append(f"/health took up to {mixed['health_max_s']:.2f} s "
                   f"({mixed['health_failures']} failed)")
    out += [f"{name} = {value} at rest" for name, value in report["at_rest"].items() if value]
    if report["rss_growth_mib"] > rss_growth_bound_mib:
        out.append(f"server RSS grew by {report['rss_growth_mib']:.0f} MiB between the first "
                   f"and the last ladder (bound {rss_growth_bound_mib:g} MiB)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=180.0)
    ap.add_argument("--rss-growth-bound-mib", type=float, default=256.0)
    ap.add_argument("--output-json", default=str(ROOT / "benchmarks/results/serve_soak.json"))
    args = ap.parse_args()
    from tests.server.openai_server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["tiny-qwen2", *SOAK_SERVER_ARGS, "--no-show-progress"],
                               Path(tmp) / "server.log")
        try:
            report = run_soak(server.url, server.port, server.proc.pid, args.duration_s)
        finally:
            code = server.stop()
    report["server_exit_code"] = code
    report["rss_growth_bound_mib"] = args.rss_growth_bound_mib
    report["problems"] = problems(report, args.rss_growth_bound_mib)
    Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    for s in report["stages"]:
        print(f"ladder {s['ladder']}  {s['request_rate']:>5} req/s  x{s['max_concurrency']:<4}"
              f"  done {s['completed']:>4}  failed {s['failed']}  p99 TTFT "
              f"{s['p99_ttft_ms']:8.1f} ms  RSS {s['rss_mib']:7.0f} MiB")
    print(f"RSS growth {report['rss_growth_mib']:.0f} MiB (bound {args.rss_growth_bound_mib:g}); "
          f"at rest {report['at_rest']}")
    print(f"mixed traffic {report['mixed']['statuses']}; /health at most "
          f"{report['mixed']['health_max_s']:.3f} s")
    if report["problems"]:
        print("problems:", *report["problems"], sep="\n  ")
    else:
        print("ok")
    return 1 if report["problems"] or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
