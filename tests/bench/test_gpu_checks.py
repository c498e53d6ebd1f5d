"""The GPU check suite on CPU: every stage of benchmarks/gpu_checks.py end to end with --dry-run
(the same code as on a GPU, tiny shapes, interpret-mode kernels), each stage's JSON holding
passing checks with real numbers; the lease plan's dry run (probe and tiny come from it), its
deadline and its trace summary; and scripts/gpu_prepare.sh /
gpu_validate.sh cutting a model file into sha256-listed chunks under a carry limit and putting
it back together."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.py"


def run_stage(stage: str, out: Path, *extra: str, timeout: int = 1000):
    """gpu_checks.py on CPU; `stage` may name several, space-separated (the JSON returned is
    the first one's; for `lease`, lease.json)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("OUT", None)
    stages = stage.split()
    proc = subprocess.run([sys.executable, str(SCRIPT), *stages, "--out", str(out), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    path = out / f"{stages[0]}.json"
    return proc, json.loads(path.read_text()) if path.exists() else None


@pytest.fixture(scope="module")
def all_stages(tmp_path_factory) -> Path:
    """Every stage but probe and tiny (the lease plan's dry run below runs those), dry run, one
    process (JAX and the engines' imports start once); without torch (the Hugging Face oracle)
    only the stages that need none."""
    import importlib.util

    out = tmp_path_factory.mktemp("gpu_checks")
    if importlib.util.find_spec("torch") is None:
        proc, _ = run_stage("kernels realshape", out, "--dry-run")
    else:
        proc, _ = run_stage("kernels realshape parity bench", out, "--dry-run")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


@pytest.fixture(scope="module")
def lease(tmp_path_factory) -> Path:
    """The lease plan's dry run: the command a lent GPU gets, on CPU at the dry run's sizes."""
    pytest.importorskip("torch", reason="the tiny part's Hugging Face oracle needs torch")
    out = tmp_path_factory.mktemp("lease")
    proc, _ = run_stage("lease", out, "--dry-run")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out


def dry_run(stage: str, out: Path) -> dict[str, dict]:
    doc = json.loads((out / f"{stage}.json").read_text())
    assert doc["stage"] == stage and doc["dry_run"] and doc["failed"] == []
    checks = {c["name"]: c for c in doc["checks"]}
    not_ok = {n: c for n, c in checks.items() if c["ok"] is not True}
    assert not not_ok, not_ok  # none failed, none skipped by the time box
    assert all(c["seconds"] >= 0 for c in checks.values())
    return checks


def test_probe_and_kernels(lease, all_stages):
    import jax

    checks = dry_run("probe", lease)
    assert checks["versions"]["jax"] == jax.__version__
    assert checks["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    go = checks["pallas_go_no_go"]
    assert go["backend"] == "interpret" and 0 <= go["max_abs_err"] < 1e-4
    assert checks["hbm_copy"]["gbps"] > 0 and checks["bf16_gemm"]["tflops"] > 0

    checks = dry_run("kernels", all_stages)
    tests = checks["pallas_kernel_tests"]
    # On CPU every [pallas] case is collected and skips; none fails.
    assert tests["tests"] >= 1 and tests["skipped"] == tests["tests"] and tests["failures"] == 0
    bench = checks["kernel_bench"]
    hbm = bench["measured_hbm_gbps"]
    assert hbm > 0 and {r["backend"] for r in bench["rows"]} == {"interpret", "reference"}
    for row in bench["rows"]:
        assert row["ms"] > 0 and not row["error"]
        assert row["percent_of_measured_hbm"] == pytest.approx(100 * row["gbps"] / hbm,
                                                               rel=1e-3)


def test_tiny(lease):
    from benchmarks.gpu.harness import sizes_for

    checks = dry_run("tiny", lease)
    f32 = checks["f32_pallas_eq_reference_eq_hf"]
    assert f32["mismatched_prompts"] == [] and f32["prompts"] == 8
    assert f32["tokens_per_prompt"] == sizes_for(True, None).tiny_new_tokens
    bf16 = checks["bf16_logprob_close"]
    assert bf16["positions_compared"] >= 8 and bf16["pool"]["free_blocks"] > 0
    split = checks["split_k_end_to_end"]
    assert max(split["decode_splits"]) > 1 and split["same_as_hf"]
    pressure = checks["preemption_chunked_prefill_prefix_hits"]
    assert pressure["multiprocess"] and pressure["same_as_hf"] and pressure["preemptions"] > 0
    assert pressure["blocks_to_hold_all"] > pressure["kv_blocks"]
    assert pressure["longest_prompt"] > pressure["token_budget"]
    # At least one full block of the shared 48-token prefix is reused (the small pool may have
    # evicted the rest).
    assert min(pressure["cached_tokens_of_prefix_prompts"]) >= 16
    # The same invariants hold with the engine core in this process and in its own.
    for mode in ("", "multiprocess_"):
        warm = checks[mode + "zero_compiles_after_warmup"]
        assert warm["compiles_after_warmup"] == 0 and warm["same_tokens_again"]
        kv = checks[mode + "kv_in_place_every_bucket"]
        assert kv["kv_bytes"] > 0 and len(kv["buckets"]) >= 4
        for b in kv["buckets"]:
            assert b["kv_copies"] == 0 and b["alias_bytes"] >= kv["kv_bytes"]
        pool = checks[mode + "kv_pool_free"]
        assert pool["free_blocks"] == pool["usable_blocks"] > 0
    # 14 blocks less the null block in the multiprocess engine.
    assert checks["multiprocess_kv_pool_free"]["usable_blocks"] == 13


def test_realshape(all_stages):
    from benchmarks.gpu.realshape import DRY_RUN_SHAPE as shape

    checks = dry_run("realshape", all_stages)
    r = checks[f"realshape_{shape.name}"]
    assert r["params"] == shape.params()
    assert r["weight_bytes"] >= 2 * shape.params()  # bfloat16 weights, plus RoPE tables
    assert r["kv_blocks"] >= 2 and r["kv_bytes"] > 0 and r["compile_total_s"] > 0
    assert r["buckets"] and r["backend_compiles"] >= len(r["buckets"])
    assert len(r["backend_compile_s"]) >= len(r["buckets"])
    assert all(s > 0 for s in r["backend_compile_s"])
    assert [m["bucket"] for m in r["memory_analysis"]] == [b["bucket"] for b in r["buckets"]]
    assert all(m["alias"] >= r["kv_bytes"] for m in r["memory_analysis"])


def test_parity(all_stages):
    pytest.importorskip("torch", reason="the Hugging Face oracle needs torch")
    checks = dry_run("parity", all_stages)
    f32 = checks["f32_logits_and_greedy_vs_hf"]
    assert 0 <= f32["max_abs_logprob_diff"] < 2e-3 and all(f32["greedy_same_as_hf"])
    assert checks["bf16_logprob_close"]["positions_compared"] >= 2
    assert checks["engine_under_pressure"]["same_as_ample_kv"]


def test_bench(all_stages):
    pytest.importorskip("torch", reason="the Hugging Face oracle needs torch")
    checks = dry_run("bench", all_stages)
    sweep = checks["dry-run-tiny_sweep"]["result"]
    assert sweep and (all_stages / "bench_dry-run-tiny_sweep.json").exists()
    lat = checks["dry-run-tiny_latency_batch1"]
    assert lat["measured_decode_step_ms"] > 0 and lat["h100_model_step_ms"] > 0
    assert lat["result"]["hf"] and lat["result"]["latency_mean"] > 0
    # Both sides of the CUDA-graph A/B measured (on CPU the flag changes nothing).
    ab = checks["dry-run-tiny_cuda_graph_ab"]
    assert ab["decode_step_ms_cuda_graph_off"] == lat["measured_decode_step_ms"]
    assert ab["decode_step_ms_cuda_graph_on"] > 0
    assert ab["speedup"] == pytest.approx(ab["decode_step_ms_cuda_graph_off"]
                                          / ab["decode_step_ms_cuda_graph_on"])
    tput = checks["dry-run-tiny_throughput_ragged"]["result"]
    assert tput["hf"] and tput["output_tokens_per_second"] > 0


def checks_of(doc: dict) -> dict[str, dict]:
    assert doc["failed"] == [], doc["failed"]
    checks = {c["name"]: c for c in doc["checks"]}
    assert all(c["ok"] is True for c in checks.values()), checks
    return checks


def test_lease_plan_dry_run(lease):
    from benchmarks.gpu.lease import (
        DISPATCH_VARIANTS,
        DRY_RUN_DISPATCH_VARIANTS,
        GEMV_XLA_VARIANTS,
        NO_COMMAND_BUFFER_FLAGS,
        PARTS,
        TRACE_STEPS,
    )
    from benchmarks.gpu.trace import API_GROUPS

    # At most 8 files come back from a lent GPU: the plan leaves 7.
    files = sorted(p.name for p in lease.iterdir())
    assert files == ["bench.json", "kernels.json", "lease.json", "lease.log", "probe.json",
                     "tiny.json", "trace.json"]
    doc = json.loads((lease / "lease.json").read_text())
    assert doc["dry_run"] and doc["elapsed_s"] < doc["deadline_s"]
    assert [p["part"] for p in doc["parts"]] == [p.name for p in PARTS]
    for st in doc["parts"]:
        assert st["ok"] and not st["timed_out"] and st["returncode"] == 0, st
        assert st["seconds"] <= st["limit_s"]
    assert sorted(doc["files"]) == files
    log = (lease / "lease.log").read_text()
    assert all(f"==== {p.name} ====" in log for p in PARTS)

    # The native runs of the newest kernel paths: every [pallas] case collected, skipping on
    # CPU.
    from benchmarks.gpu.lease import NEW_KERNEL_TESTS

    tests = dry_run("kernels", lease)["pallas_kernel_tests"]
    assert tests["files"] == list(NEW_KERNEL_TESTS) and not tests["xdist"]
    assert tests["tests"] >= 4 and tests["skipped"] == tests["tests"] and tests["failures"] == 0
    assert doc["headline"]["new_kernels"]["ok"] is True
    bench = json.loads((lease / "bench.json").read_text())
    assert set(bench["parts"]) == {"dispatch", "bench-0.5b", "gemv-rates", "latency-1.5b",
                                   "latency-7b"}
    # What calling a step costs, per XLA variant (its own process, its flags in its record).
    calls = checks_of(bench["parts"]["dispatch"])
    assert set(calls) == {"platform"} | {f"dispatch_{v}" for v, _, _ in
                                         DISPATCH_VARIANTS[:DRY_RUN_DISPATCH_VARIANTS]}
    for i, (variant, flags, _) in enumerate(DISPATCH_VARIANTS[:DRY_RUN_DISPATCH_VARIANTS]):
        result = calls[f"dispatch_{variant}"]["result"]
        assert flags in result["xla_flags"] and result["kernel_backend"] == "reference"
        assert [r["num_tokens"] for r in result["results"]] == ([1, 2] if i == 0 else [1])
        for r in result["results"]:
            assert r["arguments_tree"] > 10
            assert all(r[k] > 0 for k in ("one_array_us", "step_call_us", "real_step_us",
                                          "real_step_fixed_input_us", "real_step_launch_us",
                                          "real_step_fixed_input_launch_us"))
        assert doc["headline"][f"dispatch_{variant}"]["bucket1"]["real_step_us"] > 0
    # The decode step's weight matmuls per path: XLA's under each variant, the Pallas GEMV
    # (interpret mode in the dry run) in the first.
    rates = checks_of(bench["parts"]["gemv-rates"])
    for variant, _ in GEMV_XLA_VARIANTS:
        result = rates[f"gemv_rates_{variant}"]["result"]
        paths = {(r["path"], r["rows"]) for r in result["results"]}
        want = {("xla", 1), ("xla", 8)}
        if variant == GEMV_XLA_VARIANTS[0][0]:
            want |= {("pallas-gemv", 1), ("pallas-gemv", 8)}
        assert paths == want and all(r["ms"] > 0 and r["percent_of_copy"] > 0
                                     for r in result["results"])
        assert doc["headline"][f"gemv_rates_{variant}"]["xla_rows1"]["ms"] > 0
    assert not bench["failed"]
    head = doc["headline"]
    for part, batches in (("bench-0.5b", (1, 2)), ("latency-1.5b", (1,)), ("latency-7b", (1,))):
        checks = checks_of(bench["parts"][part])
        for bs in batches:
            c = checks[f"dry-run-tiny_latency_batch{bs}"]
            # The CLI's JSON, embedded: no file of its own comes back.
            assert c["result"]["command"] == "latency" and c["tpot_ms"] > 0
            assert c["step_profile"][str(bs)]["step_ms"] > 0
            assert head[f"{part}_batch{bs}"]["step_ms"] == c["step_profile"][str(bs)]["step_ms"]
    # The batch-1 run carries the roofline and the matmul floor; the batch-2 run none.
    b1 = checks_of(bench["parts"]["bench-0.5b"])["dry-run-tiny_latency_batch1"]["result"]
    assert b1["matmul_floor"] and "roofline" not in checks_of(bench["parts"]["bench-0.5b"])[
        "dry-run-tiny_latency_batch2"]["result"]

    trace = json.loads((lease / "trace.json").read_text())
    parts = ("trace", "trace-fastest-dispatch", "trace-no-command-buffer", "trace-cuda-graph",
             "trace-pallas-gemv")
    assert set(trace["parts"]) == set(parts) and not trace["failed"]
    for part in parts:
        checks = checks_of(trace["parts"][part])
        assert checks["engine"]["cuda_graph_triton"] == (part == "trace-cuda-graph")
        if part != "trace-fastest-dispatch":  # its flags are checked below
            assert (NO_COMMAND_BUFFER_FLAGS in checks["engine"]["xla_flags"].split()) == (
                part == "trace-no-command-buffer")
        # The dry run's engines are on the reference backend, which has no Pallas GEMV.
        assert checks["engine"]["pallas_gemv_max_rows"] == 0
        for bs in (1, 2):
            c = checks[f"batch{bs}"]
            t = c["trace"]
            assert c["step_profile"]["step_ms"] > 0 and t["steps"] == TRACE_STEPS
            # On CPU the kernels are XLA's CPU thunks, on the host plane.
            assert "hlo_op" in t["kernel_source"] and "/host:CPU" in t["planes"]
            assert t["kernels_per_step"] > 0 and t["device_busy_us_per_step"] > 0
            assert 0 < t["device_busy_percent"] <= 100
            assert 0 < len(t["longest_kernels"]) <= 10
            k = t["longest_kernels"][0]
            assert k["count"] > 0 and k["total_us"] >= k["mean_us"] > 0
            assert set(t["host_api_calls_per_step"]) == set(API_GROUPS)
            # The runtime's host events ranked by time (XLA's CPU thunks among them here).
            hosts = t["host_events_per_step"]
            assert hosts and all(h["us"] > 0 and h["count"] > 0 for h in hosts)
            assert [h["us"] for h in hosts] == sorted((h["us"] for h in hosts), reverse=True)
            assert head[f"{part}_batch{bs}"]["kernels_per_step"] == t["kernels_per_step"]
    # The fastest dispatch variant's flags, taken from the dispatch part's files.
    fastest = min(((r["real_step_us"], flags) for v, flags, _ in
                   DISPATCH_VARIANTS[:DRY_RUN_DISPATCH_VARIANTS]
                   for r in calls[f"dispatch_{v}"]["result"]["results"]
                   if r["num_tokens"] == 1))[1]
    engine = checks_of(trace["parts"]["trace-fastest-dispatch"])["engine"]
    flags = engine["xla_flags"].split()
    assert (fastest in flags) if fastest else NO_COMMAND_BUFFER_FLAGS not in flags
    ab = head["fastest_dispatch_ab_batch1"]
    assert ab["speedup"] == pytest.approx(ab["step_ms_default"] / ab["step_ms_fastest"])
    ab = head["command_buffer_ab_batch1"]
    assert ab["speedup_off"] == pytest.approx(ab["step_ms_on"] / ab["step_ms_off"])
    ab = head["cuda_graph_ab_batch1"]
    assert ab["speedup"] == pytest.approx(ab["step_ms_off"] / ab["step_ms_on"])
    ab = head["pallas_gemv_ab_batch1"]
    assert ab["speedup"] == pytest.approx(ab["step_ms_xla"] / ab["step_ms_pallas_gemv"])


def test_lease_deadline_kills_and_skips(tmp_path):
    """A deadline too short for the parts asked for: the part running at its end is killed (its
    record so far kept), the rest skipped, and the command ends within the deadline and the
    kill's grace."""
    import time

    from benchmarks import gpu_checks
    from benchmarks.gpu.lease import PARTS

    with pytest.raises(SystemExit):
        gpu_checks.main(["lease", "--parts", "probe,nosuchpart"])
    start = time.monotonic()
    # Every part after probe, in 15 s of parts: however fast this machine runs them, the
    # deadline falls while one runs (killed at its limit) or between two (the rest skipped).
    names = [p.name for p in PARTS if p.name != "tiny"]
    proc, doc = run_stage("lease", tmp_path, "--dry-run", "--deadline", "25", "--parts",
                          ",".join(names))
    elapsed = time.monotonic() - start
    assert doc is not None, (proc.stdout + proc.stderr)[-3000:]
    assert elapsed < 25 + 25  # the deadline, the kill's grace, start-up on a busy machine
    parts = {p["part"]: p for p in doc["parts"]}
    assert list(parts) == names
    skipped = [name for name, p in parts.items() if p.get("skipped") == "deadline"]
    assert skipped and skipped == names[len(names) - len(skipped):]  # the last ones
    assert all(p == {"part": name, "ok": None, "skipped": "deadline", "left_s": p["left_s"]}
               and p["left_s"] < 1.0 for name, p in parts.items() if name in skipped)
    killed = [name for name, p in parts.items() if p.get("timed_out")]
    assert len(killed) <= 1 and (killed or parts[names[len(names) - len(skipped) - 1]]["ok"])
    # A part killed at its limit fails the command; parts skipped for want of time do not.
    assert proc.returncode == (1 if killed else 0), (proc.stdout + proc.stderr)[-3000:]
    for p in parts.values():
        if "limit_s" in p:
            assert p["seconds"] <= p["limit_s"] + 12  # the kill's grace
    for name in killed:  # what it had written came back, whole
        group = next(p.group for p in PARTS if p.name == name)
        if (tmp_path / f"{group}.json").exists():
            assert json.loads((tmp_path / f"{group}.json").read_text())["stage"] == group


def test_trace_summary_of_a_gpu_shaped_xspace():
    """The parser on planes shaped like a GPU trace: kernels from the device plane's stream
    lines only, copies apart, busy time as the union over streams, the host's CUDA API calls
    grouped per step."""
    from types import SimpleNamespace as NS

    from benchmarks.gpu.trace import summarize_xspace

    def ev(name, start, dur, **stats):
        return NS(name=name, start_ns=start, duration_ns=dur, stats=list(stats.items()))

    stream7 = NS(name="Stream #7(Compute)", events=[
        ev("gemv_fusion", 0, 10_000, graph_id=3), ev("gemv_fusion", 20_000, 10_000, graph_id=3),
        ev("MemcpyHtoD", 40_000, 2_000, memcpy_details="x")])
    stream8 = NS(name="Stream #8", events=[ev("rms_norm", 5_000, 10_000)])  # overlaps 7
    derived = NS(name="XLA Ops", events=[ev("gemv_fusion", 0, 10_000)])
    device = NS(name="/device:GPU:0", lines=[stream7, stream8, derived], stats=[])
    cupti = NS(name="/host:CUPTI", stats=[], lines=[NS(name="tid 1", events=[
        ev("cuLaunchKernelEx", 0, 1), ev("cuLaunchKernel", 0, 1), ev("cuGraphLaunch", 0, 1),
        ev("cuGraphExecUpdate_v2", 0, 1), ev("cuGraphInstantiateWithFlags", 0, 1),
        ev("cuMemcpyHtoDAsync_v2", 0, 1), ev("cuStreamSynchronize", 0, 1)])])
    cpu = NS(name="/host:CPU", stats=[], lines=[NS(name="python", events=[
        ev("CommandBufferThunk::ExecuteOnStream", 0, 1), ev("PjitFunction(step)", 0, 1),
        ev("PjRtLoadedExecutable::Execute", 0, 3_000),
        ev("PjRtLoadedExecutable::Execute", 0, 1_000),
        ev("model_runner.py:300 execute_model", 0, 9_000), ev("$builtins isinstance", 0, 9_000)])])
    s = summarize_xspace(NS(planes=[device, cupti, cpu]), steps=2)
    assert s["kernel_source"] == "/device:GPU:0 (stream lines)"
    assert (s["kernels"], s["kernels_per_step"], s["copies_per_step"]) == (3, 1.5, 0.5)
    assert s["graph_launched_kernels_per_step"] == 1.0
    # Busy: [0, 15) + [20, 30) + [40, 42) us of a 42 us span.
    assert s["device_busy_us"] == pytest.approx(27.0) and s["device_span_us"] == 42.0
    assert s["device_busy_percent"] == pytest.approx(100 * 27 / 42)
    assert s["longest_kernels"][0] == {"name": "gemv_fusion", "count": 2, "total_us": 20.0,
                                       "mean_us": 10.0}
    assert s["host_api_calls_per_step"] == {"launch_kernel": 1.0, "graph_launch": 0.5,
                                            "graph_update": 0.5, "graph_instantiate": 0.5,
                                            "memcpy": 0.5}
    assert s["host_api_calls_by_name_per_step"]["cuStreamSynchronize"] == 0.5
    assert s["command_buffer_events_per_step"] == {"CommandBufferThunk::ExecuteOnStream": 0.5}
    # The runtime's host events by time per step; the Python tracer's frames left out.
    assert s["host_events_per_step"][0] == {"name": "PjRtLoadedExecutable::Execute",
                                            "count": 1.0, "us": 2.0}
    assert not any(".py" in h["name"] or h["name"].startswith("$")
                   for h in s["host_events_per_step"])


def test_time_box_skips_and_cpu_refused(tmp_path):
    # A spent time box records every sub-check as skipped (and that is no failure).
    proc, doc = run_stage("probe", tmp_path / "box", "--dry-run", "--time-box", "1e-9")
    assert proc.returncode == 0 and doc is not None, proc.stderr[-2000:]
    assert doc["checks"] and all(c["skipped"] == "time box" for c in doc["checks"])
    # A real run on CPU fails at its first check and runs nothing else.
    proc, doc = run_stage("probe", tmp_path / "real")
    assert proc.returncode == 1 and doc is not None
    assert [(c["name"], c["ok"], c["backend"]) for c in doc["checks"]] == [
        ("platform", False, "cpu")]


def test_stage_error_is_a_failed_check_and_the_next_stage_runs(tmp_path, monkeypatch):
    from benchmarks import gpu_checks

    def broken(run) -> None:
        raise RuntimeError("raised outside any sub-check")

    def fine(run) -> None:
        run.check("one", lambda: {"ok": True, "value": 7})

    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # main sets it when unset
    monkeypatch.setitem(gpu_checks.STAGE_FNS, "probe", broken)
    monkeypatch.setitem(gpu_checks.STAGE_FNS, "kernels", fine)
    assert gpu_checks.main(["probe", "kernels", "--dry-run", "--out", str(tmp_path)]) == 1
    probe = json.loads((tmp_path / "probe.json").read_text())
    (error,) = probe["checks"]
    assert (error["name"], error["ok"], probe["failed"]) == ("stage_error", False, ["stage_error"])
    assert error["error"] == "RuntimeError: raised outside any sub-check"
    assert "in broken" in error["traceback"]
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    assert [(c["name"], c["ok"], c["value"]) for c in kernels["checks"]] == [("one", True, 7)]
    assert kernels["failed"] == []


# --------------------------------------------------------------------------- scripts


def sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})},
                          timeout=120)


def tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files
               if f and (ROOT / f.decode()).is_file())


def test_prepare_brings_every_runtime_dependency_the_gpu_image_lacks():
    """Each runtime dependency in pyproject.toml is in the GPU image or among the wheels
    scripts/gpu_prepare.sh brings (the serving ones with --serve; the embedded model's data
    packages travel as chunks), at the version pyproject pins where it pins one."""
    import re
    import tomllib

    script = (ROOT / "scripts" / "gpu_prepare.sh").read_text()

    def bash_array(name: str) -> list[str]:
        body = re.search(rf"^{name}=\(([^)]*)\)", script, re.MULTILINE)
        assert body, name
        return body.group(1).split()

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    image = {norm(n) for n in bash_array("GPU_IMAGE_HAS")}
    wheels = {norm(w.split("==")[0]): w.split("==")[1]
              for w in bash_array("RUNTIME_WHEELS") + bash_array("SERVE_WHEELS")}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = norm(re.match(r"[A-Za-z0-9_.-]+", dep).group(0))
        if name.startswith("pandas-sns-"):  # the embedded model: chunks, not wheels
            continue
        assert name in image or name in wheels, f"{dep}: neither in the image nor a wheel"
        pin = re.search(r"==([^,;\s]+)", dep)
        if pin and name in wheels:
            assert wheels[name] == pin.group(1), f"{dep}: the wheel is {wheels[name]}"


def test_prepare_chunks_and_validate_assembles(tmp_path):
    model = tmp_path / "stand-in.gguf"
    data = os.urandom(2_500_000)
    model.write_bytes(data)
    dest = tmp_path / "gpu"
    limit = tree_bytes() + (1 << 20) + 1_000_000
    proc = sh("scripts/gpu_prepare.sh", str(dest), "--no-wheels", "--no-tokenizer", "--model",
              str(model), "--carry-limit-bytes", str(limit), "--first-chunk-bytes", "300000")
    assert proc.returncode == 0, proc.stderr
    assert not (dest / "wheels").exists() and (dest / "project.tar.gz").stat().st_size > 0
    lines = [line.split() for line in (dest / "manifest.txt").read_text().splitlines()]
    *chunks, whole = lines
    assert whole == [hashlib.sha256(data).hexdigest(), str(len(data)), model.name]
    sizes = [int(size) for _, size, _ in chunks]
    # Each chunk travels beside the working tree under the carry limit; the first is smaller.
    assert sizes[0] == 300_000 and sizes[1:-1] == [limit - tree_bytes() - (1 << 20)] * 2
    assert sum(sizes) == len(data) and all(tree_bytes() + s <= limit for s in sizes)
    offset = 0
    for sha, size, name in chunks:
        body = (dest / "model" / name).read_bytes()
        assert hashlib.sha256(body).hexdigest() == sha and body == data[offset:offset + int(size)]
        offset += int(size)

    # Two calls, each bringing some chunks, on one machine (a shared cache directory).
    cache = tmp_path / "cache"
    for i, names in enumerate((["chunk-00", "chunk-01"], ["chunk-02", "chunk-03"])):
        call = tmp_path / f"call{i}"
        (call / "model").mkdir(parents=True)
        (call / "manifest.txt").write_bytes((dest / "manifest.txt").read_bytes())
        for name in names:
            (call / "model" / name).write_bytes((dest / "model" / name).read_bytes())
        proc = sh("scripts/gpu_validate.sh", "--assemble-only",
                  env={"GPU_DIR": str(call), "GPU_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stderr
        assert ("waiting for 2 chunks" in proc.stdout) == (i == 0), proc.stdout
    assert (cache / "jaxllm" / "models" / model.name).read_bytes() == data

    # A damaged chunk is refused, naming it.
    bad = tmp_path / "bad"
    (bad / "model").mkdir(parents=True)
    (bad / "manifest.txt").write_bytes((dest / "manifest.txt").read_bytes())
    (bad / "model" / "chunk-01").write_bytes(b"x" * sizes[1])
    proc = sh("scripts/gpu_validate.sh", "--assemble-only",
              env={"GPU_DIR": str(bad), "GPU_CACHE": str(tmp_path / "cache2")})
    assert proc.returncode != 0 and "chunk-01: sha256" in proc.stderr


def test_validate_refuses_cpu_and_bad_stage(tmp_path):
    env = {"GPU_DIR": str(tmp_path / "none"), "GPU_CACHE": str(tmp_path / "cache"),
           "OUT": str(tmp_path / "out")}
    proc = sh("scripts/gpu_validate.sh", "nosuchstage", env=env)
    assert proc.returncode == 2 and "unknown stage 'nosuchstage'" in proc.stderr
    proc = sh("scripts/gpu_validate.sh", "probe", "nosuchstage", env=env)
    assert proc.returncode == 2 and "unknown stage 'nosuchstage'" in proc.stderr
    # JAX_PLATFORMS=cuda on a machine without a GPU: an error, never a CPU run.
    proc = sh("scripts/gpu_validate.sh", "probe", env=env)
    assert proc.returncode != 0 and not (tmp_path / "out" / "probe.json").exists()
