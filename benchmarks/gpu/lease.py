"""The lease plan: everything one command on a lent GPU should measure, inside one deadline.

    python benchmarks/gpu_checks.py lease [--dry-run] [--out DIR] [--deadline S] [--parts P,..]

Parts run one after another, each in its own process group under its own time limit (cut to
what is left of the deadline), so a hung compile or a slow part costs that part only and the
command ends before the machine's 10-minute limit. A part is not started when less than its
minimum is left. Each part writes its record into a private directory; while it runs and when
it ends, the plan copies what it has into DIR, so whatever is killed, DIR holds every number
measured so far, in at most 7 files: lease.json (the plan, each part's status, the headline
numbers), lease.log (every part's output), probe.json and tiny.json (the stages of those
names), kernels.json (the native kernel tests' record), bench.json and trace.json (their parts'
records, each CLI run's JSON inside).

Run as `python -m benchmarks.gpu.lease PART ...`, this module is one part's process."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.bench import bench_cli, write_random_checkpoint
from benchmarks.gpu.engine_checks import stage_tiny
from benchmarks.gpu.harness import (
    DRY_RUN_TIME_BOX_S,
    ROOT,
    Sizes,
    StageRun,
    platform_check,
    run_recorded,
    sizes_for,
)
from benchmarks.gpu.probe import pallas_tests, stage_probe
from benchmarks.gpu.realshape import DRY_RUN_SHAPE, shape_named

# gpu_validate.sh's own set-up takes up to ~30 s of the 10-minute command before this starts.
DEFAULT_DEADLINE_S = 540.0
# CPU-only CI machines are slower and busier than the lent GPU: a dry run gets more room.
DRY_RUN_DEADLINE_S = 900.0
# Left at the end for killing a part and writing the last files.
RESERVE_S = 10.0
POLL_S = 5.0
TRACE_STEPS = 20
LOG_TAIL_BYTES = 200_000


@dataclass(frozen=True)
class Part:
    name: str
    group: str  # the file in DIR that holds its record: probe, tiny, bench or trace
    limit_s: float  # its own time limit on a GPU (a dry run gives every part the same)
    min_s: float  # not started with less than this left of the deadline
    fn: Callable[[StageRun, Path], None]  # (its record, the plan's shared work directory)
    cuda_graph: bool = False  # XLA_FLAGS for CUDA graphs over custom calls, set before JAX
    xla_flags: str = ""  # added to XLA_FLAGS before JAX starts
    # (XLA_FLAGS, environment) to add before JAX starts, chosen from what earlier parts left in
    # the plan's work directory.
    env_from_work: Callable[[Path], tuple[str, dict[str, str]]] | None = None


# --------------------------------------------------------------------------- the parts


def lease_model(sizes: Sizes, name: str) -> str:
    """The shape a part runs: the named one, or the dry run's tiny stand-in."""
    return DRY_RUN_SHAPE.name if sizes.dry_run else name


def engine_config(sizes: Sizes, max_num_seqs: int) -> dict[str, Any]:
    """One engine configuration for the bench CLI and the traced engine alike, so a later
    start finds the earlier one's compiled buckets in the persistent compile cache."""
    n = sizes.bench_len
    return {"dtype": "float32" if sizes.dry_run else "bfloat16",
            "kernel_backend": sizes.engine_backend, "max_model_len": 4 * n + 16,
            "max_num_batched_tokens": sizes.bench_tokens, "max_num_seqs": max_num_seqs,
            # Every sequence at its full length twice over, and some to spare.
            "num_kv_blocks": 2 * max_num_seqs * -(-(2 * n + 16) // 16) + 8}


def cli_flags(cfg: dict[str, Any]) -> list[str]:
    return ["--skip-tokenizer-init", "--no-progress",
            *[x for k, v in cfg.items() for x in (f"--{k.replace('_', '-')}", str(v))]]


def big_batch(sizes: Sizes) -> int:
    return max(sizes.bench_batch_sizes)


def checkpoint(run: StageRun, work: Path, name: str) -> Path | None:
    """The random bf16 checkpoint at shape `name`, written once per plan into `work`."""
    path = work / name
    done = path / ".complete"

    def make() -> dict[str, Any]:
        start = time.perf_counter()
        if not done.exists():
            write_random_checkpoint(shape_named(name), path, same_layers=True)
            done.touch()
        return {"ok": True, "model": name, "write_s": time.perf_counter() - start}

    return path if run.check(f"{name}_checkpoint", make) is not None else None


def step_profile(doc: dict[str, Any]) -> dict[str, Any]:
    """The bench CLI's step profile by batch size: step, host and launch-call milliseconds."""
    return {str(p["batch_size"]): {k: p.get(k) for k in ("step_ms", "host_ms", "launch_ms",
                                                          "decode_tokens_per_second")}
            for p in doc.get("profile", []) if "step_ms" in p}


def latency_part(name: str, batches: tuple[str, ...], roofline: bool) -> Callable[
        [StageRun, Path], None]:
    """`jaxllm bench latency --profile` at shape `name`, once per batch ("1" or "big")."""

    def part(run: StageRun, work: Path) -> None:
        sizes = run.sizes
        if run.check("platform", lambda: platform_check(sizes)) is None:
            return
        model_name = lease_model(sizes, name)
        model = checkpoint(run, work, model_name)
        if model is None:
            return
        n = sizes.bench_len
        sizes_run = [1 if b == "1" else big_batch(sizes) for b in batches]
        cfg = engine_config(sizes, max(sizes_run))
        for bs in sizes_run:
            def latency(bs: int = bs) -> dict[str, Any]:
                args = ["latency", "--model", str(model), *cli_flags(cfg), "--batch-size",
                        str(bs), "--input-len", str(n), "--output-len", str(n),
                        "--num-iters", "1" if sizes.dry_run else "5", "--num-iters-warmup",
                        "1", "--profile", "--profile-batch-sizes", str(bs),
                        "--profile-input-len", str(n)]
                if not roofline or bs > 1:
                    args.append("--no-roofline")
                elif sizes.dry_run:
                    # The same code path, at sizes a busy CI machine measures in a moment.
                    args += ["--roofline-gemm-size", "256", "--roofline-copy-mib", "8"]
                rc, doc, tail = bench_cli(run, work / f"{run.stage}_batch{bs}.json", args)
                prof = step_profile(doc)
                return {"ok": rc == 0 and str(bs) in prof, "model": model_name,
                        "batch_size": bs, "tpot_ms": 1e3 * doc["tpot_mean"]
                        if "tpot_mean" in doc else None,
                        "output_tokens_per_second": doc.get("output_tokens_per_second"),
                        "step_profile": prof, "result": doc, "tail": tail}

            run.check(f"{model_name}_latency_batch{bs}", latency)

    return part


# XLA's matmul paths the gemv-rates part compares, as XLA_FLAGS added to the environment's:
# its default (autotuned cuBLAS and Triton GEMMs), cuBLAS only.
GEMV_XLA_VARIANTS = (("default", ""), ("cublas", "--xla_gpu_enable_triton_gemm=false"))


def gemv_rates_part(run: StageRun, work: Path) -> None:
    """`benchmarks/gemv_rates.py` at 0.5B shapes: a decode step's weight matmuls at 1-64 rows
    against the copy bandwidth, XLA's dots under each of GEMV_XLA_VARIANTS (each a process of
    its own: XLA reads its flags when it starts) and the Pallas GEMV (in the first)."""
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    model_name = lease_model(sizes, "qwen2.5-0.5b")
    for i, (variant, flags) in enumerate(GEMV_XLA_VARIANTS):
        def rates(variant: str = variant, flags: str = flags, first: bool = i == 0
                  ) -> dict[str, Any]:
            out = work / f"gemv_rates_{variant}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "gemv_rates.py"), "--shape",
                   model_name, "--output-json", str(out), "--paths", "xla",
                   *(["pallas-gemv"] if first else [])]
            if sizes.dry_run:
                cmd += ["--dtype", "float32", "--rows", "1", "8", "--interpret", "--reps", "1",
                        "--copy-mib", "8", "--repeats", "2"]
            env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}"
                   .strip(), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(30.0, run.seconds_left()))
            doc = json.loads(out.read_text()) if out.exists() else {}
            return {"ok": proc.returncode == 0 and bool(doc.get("results")),
                    "variant": variant, "xla_flags": flags, "result": doc,
                    "tail": (proc.stdout + proc.stderr)[-1500:]}

        run.check(f"gemv_rates_{variant}", rates)


# XLA's command buffers (CUDA graphs of a step's kernels, on by default) off.
NO_COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer="
# How the step is called, per variant: XLA_FLAGS and environment added, in a process of its
# own. A command buffer records its buffers' addresses and is updated, command by command,
# when one moves between calls: the variants after the first two keep temporaries (or every
# buffer seen stable) at fixed addresses, or use the other PjRt GPU client.
DISPATCH_VARIANTS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("default", "", {}),
    ("no_command_buffer", NO_COMMAND_BUFFER_FLAGS, {}),
    ("temp_separate_color", "--xla_gpu_temp_buffer_use_separate_color=true", {}),
    ("update_skip_temp", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP", {}),
    ("update_skip_profiled", "--xla_gpu_command_buffer_update_mode=SKIP_PROFILED", {}),
    ("tfrt_client", "", {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"}),
)
# The dry run rehearses the code path with the first two (the update modes are unknown to
# older jaxlibs, which refuse unknown flags).
DRY_RUN_DISPATCH_VARIANTS = 2


def dispatch_part(run: StageRun, work: Path) -> None:
    """`benchmarks/dispatch.py` at 0.5B shapes: what calling a step costs the host (null-body
    executables with the step's arguments, per argument and with a single array) and the real
    step back to back, with a fresh input buffer per call and with one fixed input array; at
    batch 1 and the big batch with XLA's defaults, at batch 1 under each other variant of
    DISPATCH_VARIANTS."""
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    model_name = lease_model(sizes, "qwen2.5-0.5b")
    variants = DISPATCH_VARIANTS[:DRY_RUN_DISPATCH_VARIANTS] if sizes.dry_run else \
        DISPATCH_VARIANTS
    for i, (variant, flags, extra_env) in enumerate(variants):
        def dispatch(variant: str = variant, flags: str = flags,
                     extra_env: dict[str, str] = extra_env, first: bool = i == 0
                     ) -> dict[str, Any]:
            out = work / f"dispatch_{variant}.json"
            cmd = [sys.executable, str(ROOT / "benchmarks" / "dispatch.py"), "--shape",
                   model_name, "--output-json", str(out), "--kernel-backend",
                   sizes.engine_backend, "--num-tokens", "1",
                   *([str(big_batch(sizes))] if first else [])]
            cmd += (["--dtype", "float32", "--calls", "20", "--real-steps", "5"]
                    if sizes.dry_run else
                    ["--dtype", "bfloat16", "--calls", "300", "--real-steps", "200"])
            env = {**os.environ, **extra_env,
                   "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(),
                   "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(30.0, run.seconds_left()))
            doc = json.loads(out.read_text()) if out.exists() else {}
            return {"ok": proc.returncode == 0 and bool(doc.get("results")),
                    "variant": variant, "xla_flags": flags, "env": extra_env, "result": doc,
                    "tail": (proc.stdout + proc.stderr)[-1500:]}

        run.check(f"dispatch_{variant}", dispatch)


def fastest_dispatch(work: Path) -> tuple[str, dict[str, str]]:
    """The XLA_FLAGS and environment of the dispatch variant whose real batch-1 step ran
    fastest back to back (XLA's defaults when none was measured)."""
    best: tuple[float, str, dict[str, str]] = (float("inf"), "", {})
    for variant, flags, extra_env in DISPATCH_VARIANTS:
        path = work / f"dispatch_{variant}.json"
        try:
            results = json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError):
            continue
        us = next((r.get("real_step_us") for r in results if r.get("num_tokens") == 1), None)
        if us and us < best[0]:
            best = (us, flags, extra_env)
    return best[1], best[2]


def trace_part(cuda_graph: bool, pallas_gemv: bool = False) -> Callable[[StageRun, Path], None]:
    """The 0.5B-shaped engine in this process: the bench's step profile, then a jax.profiler
    trace of TRACE_STEPS steady decode steps, at batch 1 and then the big batch. `pallas_gemv`:
    decode buckets of up to 16 rows run their weight matmuls through the Pallas GEMV (a Pallas
    backend only; the dry run's reference engines keep XLA's)."""

    def part(run: StageRun, work: Path) -> None:
        sizes = run.sizes
        if run.check("platform", lambda: platform_check(sizes)) is None:
            return
        model_name = lease_model(sizes, "qwen2.5-0.5b")
        model = checkpoint(run, work, model_name)
        if model is None:
            return
        from benchmarks.gpu.trace import trace_decode_steps
        from jaxllm import LLM
        from jaxllm.benchmarks.datasets import token_sampler_for
        from jaxllm.benchmarks.profile import profile_steps

        state: dict[str, Any] = {}
        gemv_rows = 16 if pallas_gemv and sizes.engine_backend != "reference" else 0

        def engine() -> dict[str, Any]:
            start = time.perf_counter()
            # In this process: the profiler traces only the process it runs in.
            state["llm"] = LLM(model=str(model), skip_tokenizer_init=True, show_progress=False,
                               multiprocess_mode=False, cuda_graph_triton=cuda_graph,
                               pallas_gemv_max_rows=gemv_rows,
                               **engine_config(sizes, big_batch(sizes)))
            return {"ok": True, "model": model_name, "cuda_graph_triton": cuda_graph,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "tfrt_gpu_client": os.environ.get("XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT"),
                    "pallas_gemv_max_rows": gemv_rows, "multiprocess_mode": False,
                    "start_s": time.perf_counter() - start}

        if run.check("engine", engine) is None:
            return
        llm = state["llm"]
        try:
            for bs in (1, big_batch(sizes)):
                def traced(bs: int = bs) -> dict[str, Any]:
                    prof = profile_steps(llm, token_sampler_for(llm), [bs], sizes.bench_len,
                                         8, use_tqdm=False)[0]
                    summary = trace_decode_steps(llm, bs, sizes.bench_len, TRACE_STEPS,
                                                 work / f"{run.stage}_batch{bs}")
                    return {"ok": summary["kernels_per_step"] > 0 and "step_ms" in prof,
                            "cuda_graph_triton": cuda_graph, "step_profile": prof,
                            "trace": summary}

                run.check(f"batch{bs}", traced)
        finally:
            llm.shutdown()

    return part


def _stage(fn: Callable[[StageRun], None]) -> Callable[[StageRun, Path], None]:
    return lambda run, _work: fn(run)


# Kernel paths no lease has run natively yet: sliding windows and the attention soft cap.
NEW_KERNEL_TESTS = ("tests/kernels/test_sliding_window.py", "tests/kernels/test_soft_cap.py")


def kernels_part(run: StageRun, _work: Path) -> None:
    """The [pallas] cases of `NEW_KERNEL_TESTS` on the GPU: the native Triton kernels against
    the float64 oracle (one pytest process; no xdist, whose workers would each compile)."""
    if run.check("platform", lambda: platform_check(run.sizes)) is None:
        return
    run.check("pallas_kernel_tests",
              lambda: pallas_tests(run, NEW_KERNEL_TESTS, 10, xdist=False))


PARTS: tuple[Part, ...] = (
    Part("probe", "probe", 60, 30, _stage(stage_probe)),
    Part("dispatch", "bench", 170, 50, dispatch_part),
    Part("trace", "trace", 110, 70, trace_part(False)),
    Part("trace-fastest-dispatch", "trace", 110, 70, trace_part(False),
         env_from_work=fastest_dispatch),
    Part("trace-no-command-buffer", "trace", 110, 70, trace_part(False),
         xla_flags=NO_COMMAND_BUFFER_FLAGS),
    Part("tiny", "tiny", 150, 60, _stage(stage_tiny)),
    Part("bench-0.5b", "bench", 220, 90, latency_part("qwen2.5-0.5b", ("1", "big"), True)),
    Part("gemv-rates", "bench", 90, 40, gemv_rates_part),
    Part("kernels", "kernels", 100, 40, kernels_part),
    Part("trace-cuda-graph", "trace", 110, 70, trace_part(True), cuda_graph=True),
    Part("trace-pallas-gemv", "trace", 110, 70, trace_part(False, pallas_gemv=True)),
    Part("latency-1.5b", "bench", 110, 80, latency_part("qwen2.5-1.5b", ("1",), True)),
    Part("latency-7b", "bench", 170, 120, latency_part("qwen2.5-7b", ("1",), True)),
)
PART_BY_NAME = {p.name: p for p in PARTS}
GROUPS = ("probe", "tiny", "bench", "trace", "kernels")


# --------------------------------------------------------------------------- the plan


def _dig(doc: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(doc, dict):
            doc = doc.get(key)
        elif isinstance(doc, list) and isinstance(key, int) and -len(doc) <= key < len(doc):
            doc = doc[key]
        else:
            return None
    return doc


def _checks(doc: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in (doc or {}).get("checks", [])}


def headline(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The numbers to read first, pulled out of the parts' records (None where not measured)."""
    out: dict[str, Any] = {}
    for part in ("bench-0.5b", "latency-1.5b", "latency-7b"):
        for check in _checks(docs.get(part)).values():
            if "batch_size" in check and check.get("ok"):
                bs = check["batch_size"]
                out[f"{part}_batch{bs}"] = {"model": check["model"],
                    "tpot_ms": check.get("tpot_ms"),
                    "output_tokens_per_second": check.get("output_tokens_per_second"),
                    **(check.get("step_profile") or {}).get(str(bs), {})}
    tests = _checks(docs.get("kernels")).get("pallas_kernel_tests")
    if tests is not None:
        out["new_kernels"] = {k: tests.get(k) for k in ("ok", "passed", "failures", "errors",
                                                        "skipped", "failed_tests")}
    steps: dict[str, Any] = {}
    for part in ("trace", "trace-fastest-dispatch", "trace-no-command-buffer",
                 "trace-cuda-graph", "trace-pallas-gemv"):
        for name, check in _checks(docs.get(part)).items():
            if name.startswith("batch") and check.get("ok"):
                t = check["trace"]
                out[f"{part}_{name}"] = {
                    "step_ms": _dig(check, "step_profile", "step_ms"),
                    "launch_ms": _dig(check, "step_profile", "launch_ms"),
                    "kernels_per_step": t["kernels_per_step"],
                    "device_busy_percent": t["device_busy_percent"],
                    "device_busy_us_per_step": t["device_busy_us_per_step"],
                    "host_api_calls_per_step": t["host_api_calls_per_step"],
                    "graph_launched_kernels_per_step": t["graph_launched_kernels_per_step"],
                    "host_events_top": [f"{h['name'][:60]}: {h['us']:.0f} us x{h['count']:g}"
                                        for h in t.get("host_events_per_step", [])[:6]]}
                steps[f"{part}_{name}"] = out[f"{part}_{name}"]["step_ms"]
    for name, check in _checks(docs.get("dispatch")).items():
        if name.startswith("dispatch_") and check.get("ok"):
            out[name] = {f"bucket{r['num_tokens']}": {
                k: r.get(k) for k in ("arguments_tree", "per_argument_us", "one_array_us",
                                      "step_call_us", "real_step_us",
                                      "real_step_fixed_input_us", "real_step_launch_us",
                                      "real_step_fixed_input_launch_us")}
                for r in check["result"]["results"]}
    engine = _checks(docs.get("trace-fastest-dispatch")).get("engine") or {}
    fastest = steps.get("trace-fastest-dispatch_batch1")
    out["fastest_dispatch_ab_batch1"] = {
        "xla_flags": engine.get("xla_flags"), "tfrt_gpu_client": engine.get("tfrt_gpu_client"),
        "step_ms_default": steps.get("trace_batch1"), "step_ms_fastest": fastest,
        "speedup": steps["trace_batch1"] / fastest if fastest and steps.get("trace_batch1")
        else None}
    with_cb, without_cb = steps.get("trace_batch1"), steps.get("trace-no-command-buffer_batch1")
    out["command_buffer_ab_batch1"] = {
        "step_ms_on": with_cb, "step_ms_off": without_cb,
        "speedup_off": with_cb / without_cb if with_cb and without_cb else None}
    off, on = steps.get("trace_batch1"), steps.get("trace-cuda-graph_batch1")
    out["cuda_graph_ab_batch1"] = {"step_ms_off": off, "step_ms_on": on,
                                   "speedup": off / on if off and on else None}
    for name, check in _checks(docs.get("gemv-rates")).items():
        if name.startswith("gemv_rates_") and check.get("ok"):
            out[name] = {f"{r['path']}_rows{r['rows']}": {
                "ms": r["ms"], "percent_of_copy": r["percent_of_copy"]}
                for r in check["result"]["results"]}
    gemv = steps.get("trace-pallas-gemv_batch1")
    out["pallas_gemv_ab_batch1"] = {"step_ms_xla": off, "step_ms_pallas_gemv": gemv,
                                    "speedup": off / gemv if off and gemv else None}
    return out


class Plan:
    """The parts' records and status, copied into DIR as they change."""

    def __init__(self, out: Path, dry_run: bool, deadline_s: float):
        self.out, self.dry_run, self.deadline_s = out, dry_run, deadline_s
        self.started = time.monotonic()
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_lease_"))
        self.parts_dir = self.tmp / "parts"
        self.work = self.tmp / "work"
        self.parts_dir.mkdir()
        self.work.mkdir()
        self.running: subprocess.Popen[bytes] | None = None  # the part running now
        self.status: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def docs(self) -> dict[str, dict[str, Any]]:
        docs = {}
        for part in PARTS:
            path = self.parts_dir / f"{part.name}.json"
            try:
                docs[part.name] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # not started, or caught between its writes: the next copy has it
        return docs

    def publish(self) -> None:
        """Rewrite DIR's files from the parts' records (each written whole, then renamed)."""
        docs = self.docs()
        files: dict[str, Any] = {}
        for group in GROUPS:
            members = [p.name for p in PARTS if p.group == group and p.name in docs]
            if group in ("probe", "tiny", "kernels"):
                if members:
                    files[group] = docs[members[0]]
            elif members:
                files[group] = {"stage": group, "dry_run": self.dry_run,
                                "parts": {m: docs[m] for m in members},
                                "failed": {m: docs[m]["failed"] for m in members
                                           if docs[m].get("failed")}}
        files["lease"] = {"stage": "lease", "dry_run": self.dry_run,
                          "deadline_s": self.deadline_s,
                          "elapsed_s": round(time.monotonic() - self.started, 3),
                          "parts": self.status, "headline": headline(docs),
                          "files": sorted(f"{g}.json" for g in files) + ["lease.json",
                                                                         "lease.log"]}
        self.out.mkdir(parents=True, exist_ok=True)
        for group, doc in files.items():
            tmp = self.out / f".{group}.json.tmp"
            tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
            os.replace(tmp, self.out / f"{group}.json")
        with open(self.out / ".lease.log.tmp", "wb") as log:
            for st in self.status:
                path = self.parts_dir / f"{st['part']}.log"
                if path.exists():
                    log.write(f"==== {st['part']} ====\n".encode())
                    with open(path, "rb") as f:
                        f.seek(max(0, path.stat().st_size - LOG_TAIL_BYTES))
                        log.write(f.read())
        os.replace(self.out / ".lease.log.tmp", self.out / "lease.log")

    def run_part(self, part: Part, limit_s: float) -> dict[str, Any]:
        """The part in its own process group, killed at `limit_s`; DIR refreshed meanwhile."""
        # The part stops starting sub-checks a little before it would be killed.
        box = max(1.0, limit_s - min(20.0, 0.2 * limit_s))
        cmd = [sys.executable, "-m", "benchmarks.gpu.lease", part.name, "--out",
               str(self.parts_dir), "--work", str(self.work), "--time-box", f"{box:.1f}",
               *(["--dry-run"] if self.dry_run else [])]
        env = {**os.environ,
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        entry: dict[str, Any] = {"part": part.name, "limit_s": round(limit_s, 1),
                                 "time_box_s": round(box, 1)}
        self.status.append(entry)
        start = time.monotonic()
        with open(self.parts_dir / f"{part.name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self.running = proc
            entry["timed_out"] = False
            while True:
                try:
                    wait = min(POLL_S, max(0.1, limit_s - (time.monotonic() - start)))
                    entry["returncode"] = proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    entry["seconds"] = round(time.monotonic() - start, 1)
                    self.publish()
                    if time.monotonic() - start >= limit_s:
                        entry["timed_out"] = True
                        entry["returncode"] = _kill_group(proc)
                        break
            self.running = None
        entry["seconds"] = round(time.monotonic() - start, 1)
        doc = self.docs().get(part.name, {})
        entry["failed"] = doc.get("failed", [])
        entry["ok"] = entry["returncode"] == 0 and not entry["timed_out"] and bool(doc)
        self.publish()
        return entry


def _kill_group(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the part's process group (its engine cores and CLI runs too), SIGKILL after
    10 s; returns the exit status."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def run_lease(out: Path, dry_run: bool, deadline_s: float | None = None,
              only: tuple[str, ...] = ()) -> int:
    """Every part in turn (or those named in `only`) within the deadline; 1 if any part failed
    or was killed."""
    unknown = set(only) - set(PART_BY_NAME)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; the parts: {list(PART_BY_NAME)}")
    plan = Plan(out, dry_run, deadline_s or (DRY_RUN_DEADLINE_S if dry_run
                                             else DEFAULT_DEADLINE_S))
    # A part runs in a session of its own (killed at its limit as a group): when this command is
    # stopped instead, the part is stopped with it, not left holding the device.
    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for part in PARTS:
            if only and part.name not in only:
                continue
            left = plan.left() - RESERVE_S
            limit = DRY_RUN_TIME_BOX_S if dry_run else part.limit_s
            # A dry run starts every part it can: it rehearses them all.
            if left < (1.0 if dry_run else part.min_s):
                plan.status.append({"part": part.name, "ok": None, "skipped": "deadline",
                                    "left_s": round(left, 1)})
                plan.publish()
                print(f"[lease] {part.name}: skipped, {left:.0f} s left", flush=True)
                continue
            print(f"[lease] {part.name}: limit {min(limit, left):.0f} s ...", flush=True)
            entry = plan.run_part(part, min(limit, left))
            print(f"[lease] {part.name}: {'ok' if entry['ok'] else 'FAILED'} in "
                  f"{entry['seconds']:.0f} s (exit {entry['returncode']}"
                  f"{', killed at its limit' if entry['timed_out'] else ''}"
                  f"{', failed: ' + ', '.join(entry['failed']) if entry['failed'] else ''})",
                  flush=True)
    finally:
        if plan.running is not None and plan.running.poll() is None:
            _kill_group(plan.running)
        signal.signal(signal.SIGTERM, previous)
        plan.publish()
        shutil.rmtree(plan.tmp, ignore_errors=True)  # the checkpoints: up to ~16 GB
    print(json.dumps(headline_brief(json.loads((out / "lease.json").read_text())), indent=1),
          flush=True)
    return 1 if any(st.get("ok") is False for st in plan.status) else 0


def headline_brief(lease: dict[str, Any]) -> dict[str, Any]:
    """lease.json's parts and headline, short enough for the command's output tail."""
    return {"parts": {st["part"]: "skipped" if st.get("ok") is None else
                      ("ok" if st["ok"] else "FAILED") + f" {st.get('seconds')} s"
                      for st in lease["parts"]}, "headline": lease["headline"]}


# --------------------------------------------------------------------------- one part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one part of the lease plan")
    parser.add_argument("part", choices=tuple(PART_BY_NAME))
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--time-box", type=float, required=True)
    parser.add_argument("--dry-run", action="store_true")
    ns = parser.parse_args(argv)
    part = PART_BY_NAME[ns.part]
    if part.cuda_graph:
        # XLA reads its flags once, when JAX starts its backend: before anything does.
        from jaxllm.engine.arg_utils import EngineArgs
        from jaxllm.engine.core import apply_platform_env

        apply_platform_env(EngineArgs(cuda_graph_triton=True).create_launch_config())
    flags, extra_env = part.xla_flags, {}
    if part.env_from_work is not None:
        flags, extra_env = part.env_from_work(Path(ns.work))
    if flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    os.environ.update(extra_env)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sizes = sizes_for(ns.dry_run, ns.time_box)
    failed = run_recorded(part.name, lambda run: part.fn(run, Path(ns.work)), Path(ns.out),
                          sizes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
