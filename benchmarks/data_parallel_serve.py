"""Data parallelism on one host: `jaxllm serve` with one and two engine cores, driven by
`jaxllm bench serve` with the same workloads.

    python benchmarks/data_parallel_serve.py            # both groups, 2 rounds, ~12 min on 2 CPUs
    python benchmarks/data_parallel_serve.py --groups routing --rounds 1 --model tiny-qwen2

Servers (each `jaxllm serve MODEL` on a free 127.0.0.1 port, started in a process group of its
own, waited for on /health within --start-timeout-s, and stopped with its whole group at the end,
whatever happens, SIGTERM and SIGHUP included):

  dp1         --data-parallel-size 1: one engine core, XLA's threads over every CPU;
  dp1-cpu0    the same, its engine core kept to CPU 0 (JAXLLM_CPU_AFFINITY=0, what the
              data-parallel client gives each of its cores on CPU; the frontend, as with dp2,
              runs anywhere): the per-core baseline, so the step from one CPU to two is visible;
  dp2         --data-parallel-size 2 --data-parallel-routing prefix (the default routing): on
              CPU each core process is kept to its own half of the CPUs;
  dp2-load    --data-parallel-size 2 --data-parallel-routing load.

Groups: the servers of a group are up together (idle ones cost no CPU) and take turns on the
group's workload, round after round (--rounds, the order rotating), so that a shared machine's
drift and its other jobs land on all of them; every round draws fresh prompts (the seeds of
round r: random --seed + 3r, prefix --seed + 3r + 1), or the prefix cache would hold them.

  scaling     dp1, dp1-cpu0, dp2 on `random`: --num-prompts random prompts of
              --random-input-len tokens, --random-output-len out (EOS ignored), all queued at
              once (--random-request-rate inf): throughput;
  routing     dp2, dp2-load on `prefix`, vLLM's prefix_repetition: --prefix-num-prefixes random
              prefixes of --prefix-len tokens (shared system prompts), each opening an equal
              share of --prefix-num-prompts prompts with a random suffix of --prefix-suffix-len
              tokens, --prefix-output-len out, in shuffled order, arriving at
              --prefix-request-rate per second (Poisson, seeded: the same arrival times on both
              servers). Where a request lands decides whether its prefix is in that core's
              prefix cache: prefix routing sends a prefix's requests to one core, load routing
              spreads them over both, which then compute it twice. Arrivals spread over time let
              a prefix be cached before the next request that shares it comes (one admitted
              while the prefix is still being computed computes it again, whatever the routing).

Every run has at most --max-concurrency requests in flight, after a few unmeasured warm-up
requests on each server. Each run records bench serve's summary (output tok/s, TTFT and TPOT
mean, median and p99, ...) and, from /metrics before and after it, each core's routed requests
(`jaxllm:engine_requests_routed`, data parallelism only) and prefix-cache queries and hits
(`jaxllm:prefix_cache_{queries,hits}_total`, labelled engine="i"), and the host's load average
before and after it; each server records its cores' pids (from /health with data parallelism,
else the server's engine-core child), their Cpus_allowed_list from /proc and the resident memory
of its process tree. The JSON (--output-json) is rewritten after every run; a markdown table is
printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Server:
    name: str
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    what: str = ""


SERVERS = {s.name: s for s in (
    Server("dp1", ("--data-parallel-size", "1"), what="DP=1, XLA over every CPU"),
    Server("dp1-cpu0", ("--data-parallel-size", "1"), {"JAXLLM_CPU_AFFINITY": "0"},
           "DP=1, its core on CPU 0"),
    Server("dp2", ("--data-parallel-size", "2", "--data-parallel-routing", "prefix"),
           what="DP=2, prefix routing"),
    Server("dp2-load", ("--data-parallel-size", "2", "--data-parallel-routing", "load"),
           what="DP=2, load routing"),
)}
# Each group: servers up together, taking turns on one workload.
GROUPS = {"scaling": (("dp1", "dp1-cpu0", "dp2"), "random"),
          "routing": (("dp2", "dp2-load"), "prefix")}
# The /metrics counters read per core.
PREFIX_QUERIES = "jaxllm:prefix_cache_queries_total"
PREFIX_HITS = "jaxllm:prefix_cache_hits_total"
ROUTED = "jaxllm:engine_requests_routed"
# The servers running now (stopped by the SIGTERM / SIGHUP handler too).
LIVE: set[subprocess.Popen] = set()


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpus_allowed(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def per_engine(metrics_text: str, name: str) -> dict[int, float]:
    """A metric's samples by their `engine` label."""
    out: dict[int, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", metrics_text,
                                    re.M):
        m = re.search(r'engine="(\d+)"', labels)
        if m:
            out[int(m.group(1))] = out.get(int(m.group(1)), 0.0) + float(value)
    return out


def scrape(url: str) -> dict[str, dict[int, float]]:
    status, text = get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return {n: per_engine(text, n) for n in (PREFIX_QUERIES, PREFIX_HITS, ROUTED)}


@contextlib.contextmanager
def running_server(model: str | None, server: Server, extra: list[str], log_path: Path,
                   start_timeout_s: float) -> Iterator[tuple[str, subprocess.Popen]]:
    """`jaxllm serve` in a process group of its own, healthy within `start_timeout_s`; the whole
    group is stopped on the way out (SIGTERM, SIGKILL after 30 s)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli.main", "serve",
           *([model] if model else []), *server.args, *extra, "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning", "--no-show-progress"]
    env = {**os.environ, **server.env}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        LIVE.add(proc)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{server.name}: the server exited with "
                                       f"{proc.returncode}:\n{_tail(log_path)}")
                with contextlib.suppress(OSError):
                    if get(url + "/health", timeout=2)[0] == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{server.name}: not healthy after {start_timeout_s} s:"
                                       f"\n{_tail(log_path)}")
                time.sleep(1.0)
            yield url, proc
        finally:
            _stop_group(proc)
            LIVE.discard(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    # The group may outlive its leader (a core still exiting): SIGKILL whatever is left.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _tail(path: Path, n: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes()[-n:].decode(errors="replace")
    return ""


def core_pids(url: str, server_pid: int) -> list[int]:
    """The engine cores' pids in core order: /health lists them with data parallelism; with
    one core, the server's engine-core child."""
    status, body = get(url + "/health")
    if status == 200 and body.strip():
        return [int(e["pid"]) for e in json.loads(body)["engines"]]
    import psutil

    return [c.pid for c in psutil.Process(server_pid).children()
            if "jaxllm.engine.core_proc" in " ".join(c.cmdline())]


def bench(port: int, argv: list[str], out: Path) -> dict[str, Any]:
    from jaxllm.entrypoints.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()):  # its report: the JSON has it all
        main(["bench", "serve", "--port", str(port), "--disable-tqdm", *argv,
              "--output-json", str(out)])
    return json.loads(out.read_text())


def workload_argv(a: argparse.Namespace, workload: str, round_: int) -> list[str]:
    """bench serve's options for one run; fresh prompts every round (the seeds of round r:
    random 3r, prefix 3r + 1, after --seed), or the prefix cache would hold them all."""
    seed = a.seed + 3 * round_
    if workload == "random":
        return ["--dataset-name", "random", "--num-prompts", str(a.num_prompts),
                "--random-input-len", str(a.random_input_len),
                "--random-output-len", str(a.random_output_len),
                "--request-rate", str(a.random_request_rate),
                "--max-concurrency", str(a.max_concurrency), "--seed", str(seed)]
    return ["--dataset-name", "prefix_repetition", "--num-prompts", str(a.prefix_num_prompts),
            "--prefix-repetition-prefix-len", str(a.prefix_len),
            "--prefix-repetition-suffix-len", str(a.prefix_suffix_len),
            "--prefix-repetition-num-prefixes", str(a.prefix_num_prefixes),
            "--prefix-repetition-output-len", str(a.prefix_output_len),
            "--request-rate", str(a.prefix_request_rate),
            "--max-concurrency", str(a.max_concurrency), "--seed", str(seed + 1)]


KEPT = ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
        "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
        "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "errors")


def engines_delta(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]],
                  pids: list[int]) -> list[dict[str, Any]]:
    indices = sorted(set(after[PREFIX_QUERIES]) | set(after[ROUTED]) | set(range(len(pids))))
    rows = []
    for i in indices:
        q, h, routed = (after[n].get(i, 0.0) - before[n].get(i, 0.0)
                        for n in (PREFIX_QUERIES, PREFIX_HITS, ROUTED))
        rows.append({"engine": i, "pid": pids[i] if i < len(pids) else None,
                     "routed": int(routed) if i in after[ROUTED] else None,
                     "prefix_cache_queries": int(q), "prefix_cache_hits": int(h),
                     "prefix_cache_hit_rate": h / q if q else None})
    return rows


def tree_rss_mib(pid: int) -> float:
    import psutil

    total = 0
    proc = psutil.Process(pid)
    for p in (proc, *proc.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total / (1 << 20)


def start_server(a: argparse.Namespace, server: Server, log_dir: Path,
                 stack: contextlib.ExitStack) -> dict[str, Any]:
    """Start `server` (stopped when `stack` closes), warm it up; what it is and where it runs."""
    extra = list(a.server_args)
    url, proc = stack.enter_context(running_server(a.model, server, extra,
                                                   log_dir / f"{server.name}.log",
                                                   a.start_timeout_s))
    port = int(url.rsplit(":", 1)[1])
    pids = core_pids(url, proc.pid)
    # Unmeasured: the first requests' one-off work (connections, first steps).
    bench(port, ["--dataset-name", "random", "--num-prompts", str(2 * len(pids) or 2),
                 "--random-input-len", "32", "--random-output-len", "4",
                 "--seed", str(a.seed + 3 * a.rounds + 2)], log_dir / "warmup.json")
    info = {"server": server.name, "what": server.what,
            "command": " ".join(["jaxllm serve", *([a.model] if a.model else []),
                                 *server.args, *extra]),
            "env": server.env, "url": url, "server_pid": proc.pid,
            "server_cpus_allowed": cpus_allowed(proc.pid),
            "rss_mib": round(tree_rss_mib(proc.pid), 1),
            "cores": [{"engine": i, "pid": p, "cpus_allowed": cpus_allowed(p)}
                      for i, p in enumerate(pids)]}
    print(f"[{server.name}] healthy; {info['rss_mib']:.0f} MiB; cores {info['cores']}",
          flush=True)
    # The pinning this benchmark is about: said loudly (and kept in the JSON) when it is not so.
    allowed = [c["cpus_allowed"] for c in info["cores"]]
    want = server.env.get("JAXLLM_CPU_AFFINITY")
    if (want and allowed != [want]) or len(set(allowed)) < len(allowed):
        info["affinity_warning"] = (f"engine cores' Cpus_allowed_list {allowed}"
                                    + (f", expected [{want!r}]" if want else ", shared"))
        print(f"[{server.name}] WARNING: {info['affinity_warning']}", file=sys.stderr,
              flush=True)
    return info


def measure(a: argparse.Namespace, info: dict[str, Any], workload: str, round_: int,
            log_dir: Path) -> dict[str, Any]:
    url = info["url"]
    argv = workload_argv(a, workload, round_)
    before = scrape(url)
    load0 = os.getloadavg()
    t0 = time.time()
    m = bench(int(url.rsplit(":", 1)[1]), argv,
              log_dir / f"{info['server']}_{workload}_{round_}.json")
    after = scrape(url)
    run = {k: v for k, v in info.items() if k != "url"}
    run.update(workload=workload, round=round_, bench_argv=argv,
               started_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
               loadavg_before=load0, loadavg_after=os.getloadavg(),
               **{k: m[k] for k in KEPT},
               engines=engines_delta(before, after, [c["pid"] for c in info["cores"]]))
    print(f"[{info['server']}/{workload}/{round_}] {m['output_throughput']:.1f} out tok/s, "
          f"TTFT p50 {m['median_ttft_ms']:.0f} ms, TPOT p50 {m['median_tpot_ms']:.0f} ms; "
          f"load {load0[0]:.2f}; engines {run['engines']}", flush=True)
    return run


def run_group(a: argparse.Namespace, group: str, log_dir: Path, report: dict[str, Any],
              save: Callable[[], None]) -> None:
    """The group's servers all up at once, its workload on each in turn, round after round
    (the order rotating), so that the machine's drift and its other jobs land on all of
    them."""
    names, workload = GROUPS[group]
    with contextlib.ExitStack() as stack:
        infos = [start_server(a, SERVERS[n], log_dir, stack) for n in names]
        for r in range(a.rounds):
            for info in infos[r % len(infos):] + infos[:r % len(infos)]:
                report["runs"].append({"group": group,
                                       **measure(a, info, workload, r, log_dir)})
                save()


def _fmt_hit(e: dict[str, Any]) -> str:
    r = e["prefix_cache_hit_rate"]
    return "-" if r is None else f"{100 * r:.0f}%"


def markdown(report: dict[str, Any]) -> str:
    lines = ["| workload | round | server | output tok/s | TTFT mean / p50 / p99 ms | "
             "TPOT p50 / p99 ms | requests routed per core | prefix-cache hit rate per core | "
             "core CPUs | load average before |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        routed = " / ".join("-" if e["routed"] is None else str(e["routed"])
                            for e in r["engines"])
        lines.append(
            f"| {r['workload']} | {r['round']} | {r['what']} | {r['output_throughput']:.1f} | "
            f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
            f"{r['median_tpot_ms']:.0f} / {r['p99_tpot_ms']:.0f} | {routed} | "
            f"{' / '.join(_fmt_hit(e) for e in r['engines'])} | "
            f"{' / '.join(str(c['cpus_allowed']) for c in r['cores'])} | "
            f"{r['loadavg_before'][0]:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="served model (default: the embedded one; tiny-qwen2 is quick)")
    ap.add_argument("--groups", nargs="+", choices=tuple(GROUPS), default=list(GROUPS))
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of the group's workload on each of its servers")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER,
                    default=["--max-model-len", "1024", "--max-num-seqs", "32"],
                    help="engine options every server gets (last on the line)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals; inf: all at once")
    ap.add_argument("--prefix-num-prompts", type=int, default=128)
    ap.add_argument("--prefix-num-prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--prefix-suffix-len", type=int, default=32)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--prefix-request-rate", type=float, default=2.0,
                    help="requests per second, Poisson arrivals (seeded: the same arrival "
                         "times on every server); inf: all at once")
    ap.add_argument("--output-json", type=Path,
                    default=ROOT / "benchmarks/results/data_parallel_serve.json")
    a = ap.parse_args()

    from importlib.metadata import version

    report: dict[str, Any] = {
        "cpu_model": cpu_model(), "cpus": sorted(os.sched_getaffinity(0)),
        "python": platform.python_version(), "jax": version("jax"),
        "model": a.model or "embedded default", "server_args": a.server_args,
        "settings": {k: v for k, v in vars(a).items() if k != "output_json"},
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "runs": []}

    def save() -> None:
        a.output_json.parent.mkdir(parents=True, exist_ok=True)
        a.output_json.write_text(json.dumps(report, indent=1) + "\n")

    def stop(signum: int, _frame: object) -> None:
        # An exception raised here could land anywhere (a GC callback swallows it): stop the
        # servers from the handler itself.
        for proc in list(LIVE):
            _stop_group(proc)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    print(f"CPU: {report['cpu_model']}, {len(report['cpus'])} CPUs", flush=True)
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        for group in a.groups:
            try:
                run_group(a, group, Path(tmp), report, save)
            except Exception as e:  # one group's failure leaves the others' numbers
                report.setdefault("failures", []).append(f"{group}: {type(e).__name__}: {e}")
                save()
                print(f"[{group}] failed: {e}", file=sys.stderr, flush=True)
                status = 1
    report["finished_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    save()
    print(markdown(report))
    return status


if __name__ == "__main__":
    sys.exit(main())
