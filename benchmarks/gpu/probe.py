"""The first stages on a lent GPU: probe (does JAX see the GPU, does a Pallas kernel run, the
measured copy bandwidth and bf16 GEMM rate) and kernels (the Pallas kernel tests, then the
kernel benchmark against the measured bandwidth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu.harness import (
    ROOT,
    StageRun,
    jax_module,
    measure_copy_gbps,
    measure_gemm_tflops,
    package_versions,
    platform_check,
)


def stage_probe(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    run.check("versions", lambda: {"ok": True, **package_versions()})

    def devices() -> dict[str, Any]:
        jax = jax_module()
        devs = []
        for d in jax.devices():
            stats = d.memory_stats() or {}
            devs.append({"id": d.id, "platform": d.platform, "kind": d.device_kind,
                         "bytes_limit": stats.get("bytes_limit"),
                         "bytes_in_use": stats.get("bytes_in_use")})
        # A GPU reports its memory; CPU devices report none.
        ok = sizes.dry_run or all(d["bytes_limit"] for d in devs)
        return {"ok": ok, "devices": devs}

    run.check("devices", devices)

    def kernel_go() -> dict[str, Any]:
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels.rms_norm import rms_norm

        jax = jax_module()
        x = jax.random.normal(jax.random.key(0), (64, 896), jnp.float32)
        w = jax.random.normal(jax.random.key(1), (896,), jnp.float32)
        r = jax.random.normal(jax.random.key(2), (64, 896), jnp.float32)
        got = jax.jit(lambda x, w, r: rms_norm(x, w, 1e-6, r, backend=sizes.kernel_backend))(
            x, w, r)
        want = jax.jit(lambda x, w, r: rms_norm(x, w, 1e-6, r, backend="reference"))(x, w, r)
        err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(h))))
                  for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
        return {"ok": err < 1e-4, "kernel": "rms_norm+residual", "backend": sizes.kernel_backend,
                "max_abs_err": err}

    run.check("pallas_go_no_go", kernel_go)
    run.check("hbm_copy", lambda: {"ok": True, "bytes": sizes.copy_bytes,
                                   "gbps": measure_copy_gbps(sizes.copy_bytes)})
    run.check("bf16_gemm", lambda: {"ok": True, "n": sizes.gemm_n,
                                    "tflops": measure_gemm_tflops(sizes.gemm_n)})


def junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def pallas_tests(run: StageRun, files: tuple[str, ...], reserve_s: float,
                 xdist: bool = True) -> dict[str, Any]:
    """The [pallas] cases of the kernel test modules `files`, in a pytest process (with
    xdist's workers when it is installed and `xdist`), stopped `reserve_s` before the time box
    ends. On CPU every such case skips (no GPU); on a GPU they must run and pass."""
    import importlib.util

    xml = run.out_dir / "kernels_pytest.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "pallas",
           f"--junitxml={xml}", *files]
    parallel = xdist and importlib.util.find_spec("xdist") is not None
    if parallel:
        # One GPU shared by the workers: each must not take most of its memory up front.
        cmd += ["-n", "4"]
    env = dict(os.environ)
    timeout = max(30.0, run.seconds_left() - reserve_s)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    (run.out_dir / "kernels_pytest.log").write_text(proc.stdout + proc.stderr)
    counts = junit_counts(xml) if xml.exists() else {}
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    ran = counts.get("passed", 0) > 0 or run.sizes.dry_run
    ok = proc.returncode == 0 and ran and not counts.get("failures") \
        and not counts.get("errors")
    return {"ok": ok, "returncode": proc.returncode, "xdist": parallel, "files": list(files),
            **counts, "failed_tests": failed[:50], "tail": (proc.stdout + proc.stderr)[-1500:]}


def stage_kernels(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return

    run.check("pallas_kernel_tests", lambda: pallas_tests(run, sizes.kernel_tests, 120))

    hbm: dict[str, float] = {}

    def copy() -> dict[str, Any]:
        hbm["gbps"] = measure_copy_gbps(sizes.copy_bytes)
        return {"ok": True, "gbps": hbm["gbps"]}

    run.check("hbm_copy", copy)

    def bench() -> dict[str, Any]:
        out = run.out_dir / "kernels_bench.json"
        peak = ["--peak-gbps", f"{hbm['gbps']:.3f}"] if hbm else []
        cmd = [sys.executable, str(ROOT / "benchmarks" / "kernels.py"), "--json", str(out),
               *peak, *sizes.kernel_bench_args]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=max(30.0, run.seconds_left()))
        doc = json.loads(out.read_text()) if out.exists() else {}
        rows = [{"kernel": r["kernel"], "phase": r["phase"], "backend": r["backend"],
                 "ms": r["time_ms"], "gbps": r["gbps"],
                 "percent_of_measured_hbm": None if r["frac_peak"] is None
                 else 100 * r["frac_peak"], "error": r["error"]} for r in doc.get("results", [])]
        ok = proc.returncode == 0 and bool(rows) and all(r["ms"] for r in rows)
        return {"ok": ok, "measured_hbm_gbps": hbm.get("gbps"), "rows": rows,
                "tail": (proc.stdout + proc.stderr)[-1500:]}

    run.check("kernel_bench", bench)
