"""The GPU check suite: one stage per call, each a list of sub-checks with pass/fail and numbers.

    python benchmarks/gpu_checks.py STAGE [--dry-run] [--out DIR] [--time-box S]

Stages: probe, kernels, tiny, realshape, parity, bench (docs/gpu.md says what each measures).
Every stage writes DIR/STAGE.json (DIR: --out, else $OUT, else ./gpu_checks_out) after each
sub-check, so a command killed at its time limit still leaves the numbers it had; a stage stops
starting sub-checks once its time box is spent and records them as skipped. The exit status is
non-zero when any sub-check failed.

A real run refuses to run anywhere but on a GPU. `--dry-run` runs every stage on CPU through the
same code with tiny shapes, the Pallas interpret backend (the reference backend where interpret
mode would take minutes), the tiny random `tiny-qwen2` in place of the embedded model and small
time boxes: what CI runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, Python puts benchmarks/ on the path: this checkout's packages come first.
sys.path.insert(0, str(ROOT))

STAGES = ("probe", "kernels", "tiny", "realshape", "parity", "bench")
# A lent GPU runs one command for at most 10 minutes: a stage leaves a minute for the rest.
DEFAULT_TIME_BOX_S = 540.0
DRY_RUN_TIME_BOX_S = 300.0
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "torch", "transformers", "triton", "flax", "numpy")


# --------------------------------------------------------------------------- sizes per run


@dataclass(frozen=True)
class Sizes:
    """Everything a stage sizes itself by: the GPU's real sizes, or tiny ones for --dry-run."""

    dry_run: bool
    kernel_backend: str  # the Pallas backend under test: pallas (GPU) or interpret (CPU)
    engine_backend: str  # ... for the engines of the tiny and parity stages
    # The backend whose step buckets must update the KV array in place: interpret mode's loops
    # copy it on CPU, so a dry run checks the reference backend's buckets.
    kv_check_backend: str
    time_box_s: float
    copy_bytes: int
    gemm_n: int
    kernel_tests: tuple[str, ...]
    kernel_bench_args: tuple[str, ...]
    tiny_vocab: int
    tiny_max_model_len: int
    split_k_max_model_len: int
    realshapes: tuple[str, ...]
    realshape_tokens: int
    realshape_seqs: int
    parity_model: str | None  # None: the embedded model
    parity_prompts: int
    bench_models: tuple[str, ...]
    bench_batch_sizes: tuple[int, ...]
    bench_len: int
    bench_prompts: int
    bench_tokens: int  # max_num_batched_tokens of the bench engines
    parity_new_tokens: int


def sizes_for(dry_run: bool, time_box_s: float | None) -> Sizes:
    if dry_run:
        # Engines in interpret mode take minutes on a small CPU: the dry run's engines use the
        # reference backend, its kernel checks interpret mode.
        return Sizes(True, "interpret", "reference", "reference",
                     time_box_s or DRY_RUN_TIME_BOX_S,
                     copy_bytes=8 << 20, gemm_n=256,
                     kernel_tests=("tests/kernels/test_rms_norm.py",),
                     kernel_bench_args=("--runs", "1", "--warmup", "1", "--kernels", "rms_norm"),
                     tiny_vocab=128, tiny_max_model_len=128, split_k_max_model_len=512,
                     realshapes=("dry-run-tiny",), realshape_tokens=16, realshape_seqs=2,
                     parity_model="tiny-qwen2", parity_prompts=2,
                     bench_models=("dry-run-tiny",), bench_batch_sizes=(1, 2), bench_len=4,
                     bench_prompts=3, bench_tokens=16, parity_new_tokens=8)
    return Sizes(False, "pallas", "pallas", "pallas", time_box_s or DEFAULT_TIME_BOX_S,
                 copy_bytes=2 << 30, gemm_n=8192, kernel_tests=("tests/kernels",),
                 kernel_bench_args=(), tiny_vocab=512, tiny_max_model_len=128,
                 split_k_max_model_len=4096,
                 realshapes=("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"),
                 realshape_tokens=512, realshape_seqs=64, parity_model=None, parity_prompts=6,
                 bench_models=("qwen2.5-0.5b", "qwen2.5-1.5b"),
                 bench_batch_sizes=(1, 2, 4, 8, 16, 32, 64), bench_len=128, bench_prompts=64,
                 bench_tokens=512, parity_new_tokens=32)


# --------------------------------------------------------------------------- recording


@dataclass
class StageRun:
    """One stage's record: sub-checks run in order, each written out as soon as it ends."""

    stage: str
    out_dir: Path
    sizes: Sizes
    started: float = field(default_factory=time.monotonic)
    checks: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.out_dir / f"{self.stage}.json"

    def seconds_left(self) -> float:
        return self.sizes.time_box_s - (time.monotonic() - self.started)

    def check(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run fn (it returns its numbers and "ok"); a raise is a failure with its traceback.
        Past the time box, records the check as skipped instead."""
        if self.seconds_left() <= 0:
            self.checks.append({"name": name, "ok": None, "skipped": "time box"})
            self.write()
            return None
        print(f"[{self.stage}] {name} ...", flush=True)
        start = time.monotonic()
        try:
            data = fn()
            entry = {"name": name, "ok": bool(data.pop("ok")), **data}
        except Exception as exc:
            data = None
            entry = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                     "traceback": traceback.format_exc()[-4000:]}
        entry["seconds"] = round(time.monotonic() - start, 3)
        self.checks.append(entry)
        self.write()
        print(f"[{self.stage}] {name}: {'ok' if entry['ok'] else 'FAILED'} "
              f"({entry['seconds']:.1f} s)", flush=True)
        if not entry["ok"]:
            print(json.dumps({k: v for k, v in entry.items() if k != "traceback"}, default=str,
                             indent=1)[:3000], flush=True)
            if "traceback" in entry:
                print(entry["traceback"], flush=True)
        return data if entry["ok"] else None

    def failed(self) -> list[str]:
        return [c["name"] for c in self.checks if c["ok"] is False]

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        doc = {"stage": self.stage, "dry_run": self.sizes.dry_run,
               "time_box_s": self.sizes.time_box_s,
               "elapsed_s": round(time.monotonic() - self.started, 3), "info": self.info,
               "checks": self.checks, "failed": self.failed()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_json_value) + "\n")
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------- shared helpers


def _json_value(value: Any) -> Any:
    """numpy scalars and arrays as JSON numbers and lists; anything else as its str()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _jax():
    import jax

    return jax


def platform_check(sizes: Sizes) -> dict[str, Any]:
    """A real run on anything but a GPU is a failure, never a silent CPU fallback."""
    jax = _jax()
    backend = jax.default_backend()
    return {"ok": sizes.dry_run or backend == "gpu", "backend": backend,
            "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()]}


class CompileCounter:
    """Backend compiles (each with its seconds) seen since creation, through JAX's public
    monitoring events; the listener stays registered, `active` turns it off."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.active = True
        _jax().monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if self.active and event == BACKEND_COMPILE_EVENT:
            self.seconds.append(duration)


def median_seconds(fn: Callable[[], Any], runs: int, warmup: int = 2) -> float:
    jax = _jax()
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_copy_gbps(nbytes: int) -> float:
    """Device copy bandwidth, counting the bytes read and written."""
    jax = _jax()
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # one read and one write of every element
    return 2 * nbytes / median_seconds(lambda: copy(x), runs=10) / 1e9


def measure_gemm_tflops(n: int) -> float:
    jax = _jax()
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / median_seconds(lambda: mm(a, b), runs=10) / 1e12


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@contextlib.contextmanager
def highest_matmul_precision() -> Iterator[None]:
    """float32 matmuls at full precision (no TF32) in this process and in engine cores started
    meanwhile in their own process."""
    jax = _jax()
    old = os.environ.get("JAX_DEFAULT_MATMUL_PRECISION")
    os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    try:
        with jax.default_matmul_precision("highest"):
            yield
    finally:
        if old is None:
            os.environ.pop("JAX_DEFAULT_MATMUL_PRECISION", None)
        else:
            os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = old


def engine_runner(llm):
    """The model runner of an in-process engine (multiprocess_mode=False): for the compiled
    executables, which no utility call returns."""
    core = llm.llm_engine.engine_core_client.engine_core
    return core.runner


def greedy_ids(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    from jaxllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def kv_pool_check(llm) -> dict[str, Any]:
    free, usable = llm.llm_engine.engine_core_client.call_utility("get_kv_block_counts")
    return {"ok": free == usable, "free_blocks": free, "usable_blocks": usable}


def top_k_close(a_out, b_out) -> dict[str, Any]:
    """Each side's greedy token at every position up to the first divergence lies within the
    other side's top-k there (the contexts differ after a divergence)."""
    compared = diverged = 0
    bad = []
    for i, (a, b) in enumerate(zip(a_out, b_out, strict=True)):
        ca, cb = a.outputs[0], b.outputs[0]
        for pos, (ta, tb) in enumerate(zip(ca.token_ids, cb.token_ids, strict=True)):
            compared += 1
            if ta == tb:
                continue
            if ta not in cb.logprobs[pos] or tb not in ca.logprobs[pos]:
                bad.append({"prompt": i, "position": pos, "tokens": [ta, tb]})
            diverged += 1
            break
    return {"ok": not bad, "positions_compared": compared, "sequences_diverged": diverged,
            "not_in_top_k": bad[:10]}


# --------------------------------------------------------------------------- probe


def stage_probe(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    run.check("versions", lambda: {"ok": True, **package_versions()})

    def devices() -> dict[str, Any]:
        jax = _jax()
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

        jax = _jax()
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


# --------------------------------------------------------------------------- kernels


def junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def stage_kernels(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return

    def pallas_tests() -> dict[str, Any]:
        import importlib.util

        xml = run.out_dir / "kernels_pytest.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "pallas",
               f"--junitxml={xml}", *sizes.kernel_tests]
        parallel = importlib.util.find_spec("xdist") is not None
        if parallel:
            # One GPU shared by the workers: each must not take most of its memory up front.
            cmd += ["-n", "4"]
        env = dict(os.environ)
        timeout = max(30.0, run.seconds_left() - 120)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        (run.out_dir / "kernels_pytest.log").write_text(proc.stdout + proc.stderr)
        counts = junit_counts(xml) if xml.exists() else {}
        failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
        # On CPU every [pallas] case skips (no GPU); on a GPU they must run and pass.
        ran = counts.get("passed", 0) > 0 or sizes.dry_run
        ok = proc.returncode == 0 and ran and not counts.get("failures") \
            and not counts.get("errors")
        return {"ok": ok, "returncode": proc.returncode, "xdist": parallel, **counts,
                "failed_tests": failed[:50], "tail": (proc.stdout + proc.stderr)[-1500:]}

    run.check("pallas_kernel_tests", pallas_tests)

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


# --------------------------------------------------------------------------- tiny


def hf_greedy(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float32 means float32: no TF32 in the oracle's matmuls or convolutions.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = hf.to(device)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new,
                              do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def tiny_prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    from tests.utils import PROMPT_LENS

    rng = np.random.default_rng(42)
    base = [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]
    # Two prompts sharing 48 tokens (3 full blocks) with the 70-token one: prefix cache hits.
    base.append(base[1][:48] + rng.integers(0, vocab, 5).tolist())
    base.append(base[1][:50] + rng.integers(0, vocab, 12).tolist())
    return base


def bucket_kv_analysis(llm) -> dict[str, Any]:
    """Per compiled step bucket: whether its HLO copies a KV-shaped array (the donated KV array
    must be updated in place) and its memory analysis (alias bytes must cover the KV array)."""
    runner = engine_runner(llm)
    kv = runner.kv_cache
    kv_bytes = int(kv.size * kv.dtype.itemsize)
    dims = ",".join(str(d) for d in kv.shape)
    copy_re = re.compile(r"=\s*\S+\[" + re.escape(dims) + r"\][^=]*\bcopy(-start)?\(")
    rows, ok = [], True
    for shape, compiled in sorted(runner._compiled.items()):
        ma = compiled.memory_analysis()
        alias = None if ma is None else int(ma.alias_size_in_bytes)
        copies = len(copy_re.findall(compiled.as_text()))
        good = copies == 0 and alias is not None and alias >= kv_bytes
        ok &= good
        rows.append({"bucket": list(shape), "kv_copies": copies, "alias_bytes": alias,
                     "temp_bytes": None if ma is None else int(ma.temp_size_in_bytes),
                     "ok": good})
    return {"ok": ok and bool(rows), "kv_bytes": kv_bytes, "kv_shape": list(kv.shape),
            "buckets": rows}


def stage_tiny(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from jaxllm import LLM
    from tests.utils import MAX_NEW, make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gpu_checks_tiny_"))
    compiles = CompileCounter()
    prompts = tiny_prompts(sizes.tiny_vocab)
    state: dict[str, Any] = {}
    base = dict(skip_tokenizer_init=True, max_model_len=sizes.tiny_max_model_len,
                max_num_seqs=8, max_num_batched_tokens=64, show_progress=False,
                multiprocess_mode=False, num_kv_blocks=64)

    def engine(**kw):
        return LLM(model=str(work / "ckpt"), **{**base, **kw})

    def make_model() -> dict[str, Any]:
        # Positions up to the split-K check's max_model_len.
        hf = make_tiny_checkpoint(work / "ckpt", tied=False, vocab_size=sizes.tiny_vocab,
                                  max_position_embeddings=max(512, sizes.split_k_max_model_len))
        state["hf"] = hf
        return {"ok": True, "vocab_size": sizes.tiny_vocab, "path": str(work / "ckpt")}

    run.check("make_checkpoint", make_model)

    def f32_greedy() -> dict[str, Any]:
        with highest_matmul_precision():
            want = hf_greedy(state["hf"], prompts, MAX_NEW)
            ref = engine(dtype="float32", kernel_backend="reference")
            state["ref_f32"] = greedy_ids(ref, prompts, MAX_NEW, logprobs=5)
            got_ref = [o.outputs[0].token_ids for o in state["ref_f32"]]
            pal = engine(dtype="float32", kernel_backend=sizes.engine_backend)
            got_pal = [o.outputs[0].token_ids for o in greedy_ids(pal, prompts, MAX_NEW)]
            # Warm: the same requests again must compile nothing.
            before = len(compiles.seconds)
            again = [o.outputs[0].token_ids for o in greedy_ids(pal, prompts, MAX_NEW)]
            state["recompiles"] = len(compiles.seconds) - before
            for llm in (ref, pal):
                if llm.llm_engine.engine_config.kernel_backend == sizes.kv_check_backend \
                        and "kv_engine" not in state:
                    state["kv_engine"] = llm
                else:
                    llm.shutdown()
        state["hf_tokens"] = want
        mism = [i for i, (a, b, c) in enumerate(zip(got_pal, got_ref, want, strict=True))
                if not a == b == c]
        return {"ok": not mism and again == got_pal, "backend": sizes.engine_backend,
                "prompts": len(prompts),
                "tokens_per_prompt": MAX_NEW, "mismatched_prompts": mism,
                "hf_device": str(next(state["hf"].parameters()).device)}

    run.check("f32_pallas_eq_reference_eq_hf", f32_greedy)
    run.check("zero_compiles_after_warmup",
              lambda: {"ok": state.get("recompiles") == 0,
                       "compiles_after_warmup": state.get("recompiles")})
    run.check("kv_in_place_every_bucket", lambda: {
        **bucket_kv_analysis(state["kv_engine"]), "backend": sizes.kv_check_backend})

    def pal_pool() -> dict[str, Any]:
        llm = state.pop("kv_engine")
        try:
            return kv_pool_check(llm)
        finally:
            llm.shutdown()

    run.check("kv_pool_free", pal_pool)

    def bf16_close() -> dict[str, Any]:
        pal = engine(dtype="bfloat16", kernel_backend=sizes.engine_backend)
        b = greedy_ids(pal, prompts, MAX_NEW, logprobs=5)
        pool = kv_pool_check(pal)
        pal.shutdown()
        res = top_k_close(state["ref_f32"], b)
        return {**res, "ok": res["ok"] and pool["ok"], "pool": pool}

    run.check("bf16_logprob_close", bf16_close)

    def split_k() -> dict[str, Any]:
        import numpy as np

        rng = np.random.default_rng(7)
        long = [rng.integers(0, sizes.tiny_vocab, n).tolist() for n in (300, 5)]
        kw = dict(max_model_len=sizes.split_k_max_model_len, max_num_seqs=2,
                  num_kv_blocks=2 * sizes.split_k_max_model_len // 16 + 2, dtype="float32")
        with highest_matmul_precision():
            # Split-K exists only in the Pallas kernels (interpret mode in a dry run).
            pal = engine(kernel_backend=sizes.kernel_backend, **kw)
            table = pal.collective_rpc("bucket_table")
            got = [o.outputs[0].token_ids for o in greedy_ids(pal, long, 16)]
            pool = kv_pool_check(pal)
            pal.shutdown()
            want = hf_greedy(state["hf"], long, 16)
        splits = sorted({s for _, q, s in table if q == 1})
        return {"ok": got == want and max(splits) > 1 and pool["ok"],
                "decode_splits": splits, "bucket_table": table, "same_as_hf": got == want}

    run.check("split_k_end_to_end", split_k)

    def pressure() -> dict[str, Any]:
        # 14 blocks of 16 tokens cannot hold the 8 prompts with their 24 new tokens at once
        # (preemption); a 16-token budget splits every longer prompt (chunked prefill); the
        # prefix-sharing prompts come after their source (prefix cache hits).
        want = state["hf_tokens"]
        with highest_matmul_precision():
            llm = engine(dtype="float32", kernel_backend=sizes.engine_backend,
                         num_kv_blocks=14, max_num_batched_tokens=16)
            first = greedy_ids(llm, prompts[:6], MAX_NEW)
            second = greedy_ids(llm, prompts[6:], MAX_NEW)
            pool = kv_pool_check(llm)
            llm.shutdown()
        got = [o.outputs[0].token_ids for o in first + second]
        need = sum(-(-(len(p) + MAX_NEW) // 16) for p in prompts[:6])
        cached = [o.num_cached_tokens for o in second]
        ok = got == want and pool["ok"] and min(cached) > 0
        return {"ok": ok, "same_as_hf": got == want, "kv_blocks": 14,
                "blocks_to_hold_all": need, "longest_prompt": max(map(len, prompts)),
                "token_budget": 16, "cached_tokens_of_prefix_prompts": cached, "pool": pool}

    run.check("preemption_chunked_prefill_prefix_hits", pressure)

    def multiprocess() -> dict[str, Any]:
        with highest_matmul_precision():
            llm = engine(dtype="float32", kernel_backend=sizes.engine_backend,
                         multiprocess_mode=True)
            got = [o.outputs[0].token_ids for o in greedy_ids(llm, prompts, MAX_NEW)]
            pool = kv_pool_check(llm)
            llm.shutdown()
        same = got == state["hf_tokens"]
        return {"ok": same and pool["ok"], "same_as_hf": same, "pool": pool}

    run.check("multiprocess_engine", multiprocess)


# --------------------------------------------------------------------------- realshape

# --dry-run's stand-in for the real shapes: two layers, widths with the real head layout.
DRY_RUN_SHAPE = dict(name="dry-run-tiny", num_layers=2, hidden_size=128, num_heads=4,
                     num_kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=512,
                     tied_embeddings=False)


def shape_named(name: str):
    from pallas_kernels.checks.shapes import QWEN2_SHAPES, Qwen2Shape

    return Qwen2Shape(**DRY_RUN_SHAPE) if name == DRY_RUN_SHAPE["name"] else QWEN2_SHAPES[name]


def random_runner(shape, sizes: Sizes, dtype: str):
    """A ModelRunner over random weights at `shape`, made on the device (no checkpoint)."""
    import jax.numpy as jnp

    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM, abstract_params
    from jaxllm.worker.model_runner import ModelRunner

    jax = _jax()
    config = ModelConfig.from_hf_config(shape.hf_config(max_position_embeddings=4096,
                                                        rope_theta=1e6, rms_norm_eps=1e-6))
    model = Qwen2ForCausalLM(config, dtype=jnp.dtype(dtype), kernel_backend=sizes.engine_backend,
                             activation_dtype=jnp.dtype(dtype), tp_axis=None)
    leaves, tree = jax.tree.flatten(abstract_params(model))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    params = jax.tree.unflatten(tree, [
        (0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
        for k, a in zip(keys, leaves, strict=True)])
    return config, ModelRunner(config, params, dtype=jnp.dtype(dtype),
                               kernel_backend=sizes.engine_backend, block_size=16,
                               max_model_len=4096 if not sizes.dry_run else 512,
                               max_num_seqs=sizes.realshape_seqs,
                               max_num_batched_tokens=sizes.realshape_tokens)


def stage_realshape(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from jaxllm.config import num_kv_blocks_for
    from jaxllm.engine.arg_utils import EngineArgs

    for name in sizes.realshapes:
        def one(name: str = name) -> dict[str, Any]:
            jax = _jax()
            shape = shape_named(name)
            dtype = "bfloat16"
            start = time.perf_counter()
            _, runner = random_runner(shape, sizes, dtype)
            jax.block_until_ready(runner.params)
            init_s = time.perf_counter() - start
            # The engine's own budget rule: gpu_memory_utilization of the device less weights
            # and the largest step's activations (the CPU default where no memory is reported).
            # The checkpoint directory holds only config.json: the runner above has the weights.
            ckpt = Path(tempfile.mkdtemp(prefix="gpu_checks_shape_"))
            (ckpt / "config.json").write_text(json.dumps(shape.hf_config()))
            config = EngineArgs(
                model=str(ckpt), dtype=dtype, kernel_backend=sizes.engine_backend,
                quantization="none", max_num_seqs=sizes.realshape_seqs,
                max_num_batched_tokens=sizes.realshape_tokens, skip_tokenizer_init=True,
                multiprocess_mode=False).create_engine_config(jax.default_backend())
            blocks = num_kv_blocks_for(config, runner)
            if sizes.dry_run:
                blocks = min(blocks, 64)  # the CPU default would take a GiB of host memory
            runner.initialize_kv_cache(blocks)
            compiles = CompileCounter()
            total = runner.compile(progress=False)
            compiles.active = False
            shapes = runner.bucket_table()
            per_bucket = [{"bucket": [t, q], "splits": s,
                           "compile_s": compiles.seconds[i] if i < len(compiles.seconds)
                           else None} for i, (t, q, s) in enumerate(shapes)]
            analysis = []
            for (t, q), compiled in sorted(runner._compiled.items()):
                ma = compiled.memory_analysis()
                analysis.append({"bucket": [t, q],
                                 "temp_bytes": None if ma is None else ma.temp_size_in_bytes,
                                 "alias_bytes": None if ma is None else ma.alias_size_in_bytes,
                                 "argument_bytes": None if ma is None
                                 else ma.argument_size_in_bytes})
            kv = runner.kv_cache
            stats = jax.devices()[0].memory_stats() or {}
            result = {"ok": blocks >= 2 and len(compiles.seconds) >= len(shapes),
                      "model": name, "params": shape.params(), "init_s": init_s,
                      "weight_bytes": runner.weight_bytes(), "kv_blocks": blocks,
                      "kv_bytes": int(kv.size * kv.dtype.itemsize), "compile_total_s": total,
                      "buckets": per_bucket, "memory_analysis": analysis,
                      "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                      "bytes_limit": stats.get("bytes_limit")}
            del runner, kv
            return result

        run.check(f"realshape_{name}", one)


# --------------------------------------------------------------------------- parity


def load_hf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return hf.to("cuda" if torch.cuda.is_available() else "cpu").eval()


PARITY_TEXTS = ("def fibonacci(n):", "The capital of France is", "import numpy as np\n",
                "SELECT name FROM users WHERE", "Once upon a time, there was",
                "# Sort a list in Python\n")


def stage_parity(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    import numpy as np

    from jaxllm import LLM, SamplingParams
    from jaxllm.config import resolve_model

    path = resolve_model(sizes.parity_model)
    state: dict[str, Any] = {}
    new = sizes.parity_new_tokens
    base = dict(model=None if sizes.parity_model is None else str(path), max_model_len=512,
                max_num_seqs=sizes.parity_prompts, max_num_batched_tokens=sizes.bench_tokens,
                show_progress=False,
                multiprocess_mode=False, kernel_backend=sizes.engine_backend,
                quantization="none", num_kv_blocks=128)

    def setup() -> dict[str, Any]:
        state["hf"] = load_hf(path)
        from transformers import AutoTokenizer

        tok_dir = os.environ.get("JAXLLM_GPU_TOKENIZER")
        if tok_dir:
            tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        else:
            from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer

            tok = load_tokenizer(path)
        state["prompts"] = [tok(t).input_ids for t in PARITY_TEXTS[:sizes.parity_prompts]]
        return {"ok": True, "model": str(path), "tokenizer": tok_dir or "from the model",
                "hf_device": str(next(state["hf"].parameters()).device)}

    run.check("load_hf_and_tokenize", setup)

    def hf_logprobs(prompt: list[int]) -> np.ndarray:
        import torch

        hf = state["hf"]
        with torch.no_grad():
            logits = hf(torch.tensor([prompt], device=next(hf.parameters()).device)).logits[0]
        return torch.log_softmax(logits.float(), -1).cpu().numpy()

    def f32() -> dict[str, Any]:
        prompts = state["prompts"]
        with highest_matmul_precision():
            llm = LLM(dtype="float32", skip_tokenizer_init=True, **base)
            sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            greedy = greedy_ids(llm, prompts, new, logprobs=5)
            pool = kv_pool_check(llm)
            llm.shutdown()
            want = hf_greedy(state["hf"], prompts, new)
        worst = 0.0
        for p, o in zip(prompts, outs, strict=True):
            ref = hf_logprobs(p)
            # prompt_logprobs[i] scores token i given tokens < i (None for the first).
            for i in range(1, len(p)):
                worst = max(worst, float(abs(o.prompt_logprobs[i][p[i]].logprob
                                             - ref[i - 1, p[i]])))
        state["f32"] = greedy
        same = [g.outputs[0].token_ids == w for g, w in zip(greedy, want, strict=True)]
        return {"ok": worst < 2e-3 and all(same) and pool["ok"], "backend": sizes.engine_backend,
                "max_abs_logprob_diff": worst, "tolerance": 2e-3, "greedy_same_as_hf": same,
                "pool": pool}

    run.check("f32_logits_and_greedy_vs_hf", f32)

    def bf16() -> dict[str, Any]:
        llm = LLM(dtype="bfloat16", skip_tokenizer_init=True, **base)
        got = greedy_ids(llm, state["prompts"], new, logprobs=5)
        pool = kv_pool_check(llm)
        llm.shutdown()
        res = top_k_close(state["f32"], got)
        return {**res, "ok": res["ok"] and pool["ok"], "pool": pool}

    run.check("bf16_logprob_close", bf16)

    def pressure() -> dict[str, Any]:
        prompts = state["prompts"] * 2
        with highest_matmul_precision():
            llm = LLM(dtype="float32", skip_tokenizer_init=True,
                      **{**base, "num_kv_blocks": 8, "max_num_batched_tokens": 16})
            got = [o.outputs[0].token_ids for o in greedy_ids(llm, prompts, new)]
            pool = kv_pool_check(llm)
            llm.shutdown()
        want = [o.outputs[0].token_ids for o in state["f32"]] * 2
        return {"ok": got == want and pool["ok"], "kv_blocks": 8, "token_budget": 16,
                "requests": len(prompts), "same_as_ample_kv": got == want, "pool": pool}

    run.check("engine_under_pressure", pressure)


# --------------------------------------------------------------------------- bench


def write_random_checkpoint(shape, path: Path, seed: int = 0) -> None:
    """A Hugging Face Qwen2 checkpoint of random bfloat16 weights at `shape`, written a tensor
    at a time (the bench CLI and HF load it like a real one)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = shape.hf_config(max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                          architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16",
                          bos_token_id=0, eos_token_id=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, \
        shape.num_kv_heads * shape.head_dim

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, ml_dtypes.bfloat16)

    save_file({"model.embed_tokens.weight": rand(shape.vocab_size, h),
               "model.norm.weight": ones(h),
               **({} if shape.tied_embeddings else
                  {"lm_head.weight": rand(shape.vocab_size, h)})},
              str(path / "model-embed.safetensors"))
    weight_map = {"model.embed_tokens.weight": "model-embed.safetensors",
                  "model.norm.weight": "model-embed.safetensors"}
    if not shape.tied_embeddings:
        weight_map["lm_head.weight"] = "model-embed.safetensors"
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        save_file({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.q_proj.bias": rand(q),
                   p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.k_proj.bias": rand(kv),
                   p + "self_attn.v_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.bias": rand(kv),
                   p + "self_attn.o_proj.weight": rand(h, q),
                   p + "mlp.gate_proj.weight": rand(shape.intermediate_size, h),
                   p + "mlp.up_proj.weight": rand(shape.intermediate_size, h),
                   p + "mlp.down_proj.weight": rand(h, shape.intermediate_size),
                   p + "input_layernorm.weight": ones(h),
                   p + "post_attention_layernorm.weight": ones(h)},
                  str(path / f"model-layer{i:03d}.safetensors"))
        for key in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                    "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                    "mlp.down_proj.weight", "input_layernorm.weight",
                    "post_attention_layernorm.weight"):
            weight_map[p + key] = f"model-layer{i:03d}.safetensors"
    # The index names each tensor's file: Hugging Face reads several files through it.
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=1))


def stage_bench(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from pallas_kernels.checks.perf_model import decode_step

    work = Path(tempfile.mkdtemp(prefix="gpu_checks_bench_"))
    n = sizes.bench_len
    dtype = "bfloat16" if not sizes.dry_run else "float32"
    engine = ["--dtype", dtype, "--kernel-backend", sizes.engine_backend,
              "--skip-tokenizer-init", "--max-model-len", str(4 * n + 16), "--no-progress",
              "--max-num-batched-tokens", str(sizes.bench_tokens)]

    def cli(name: str, model: Path, *args: str) -> tuple[int, dict[str, Any], str]:
        out = run.out_dir / f"bench_{name}.json"
        cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli.main", "bench", *args,
               "--model", str(model), *engine, "--output-json", str(out)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(30.0, run.seconds_left()))
        doc = json.loads(out.read_text()) if out.exists() else {}
        return proc.returncode, doc, (proc.stdout + proc.stderr)[-1500:]

    for name in sizes.bench_models:
        shape = shape_named(name)
        model = work / name
        # One KV budget: the largest sweep batch at its full length, with room to spare.
        blocks = str(2 * max(sizes.bench_batch_sizes) * -(-(2 * n + 16) // 16) + 8)

        def make(shape=shape, model=model) -> dict[str, Any]:
            start = time.perf_counter()
            write_random_checkpoint(shape, model)
            return {"ok": True, "model": shape.name, "write_s": time.perf_counter() - start}

        if run.check(f"{name}_checkpoint", make) is None:
            continue

        def sweep(name=name, model=model, blocks=blocks) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_sweep", model, "sweep", "--batch-sizes",
                                *map(str, sizes.bench_batch_sizes), "--input-len", str(n),
                                "--output-len", str(n), "--compare-hf", "--num-kv-blocks", blocks)
            return {"ok": rc == 0 and bool(doc), "result": doc, "tail": tail}

        run.check(f"{name}_sweep", sweep)

        def latency(name=name, model=model, blocks=blocks, shape=shape) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_latency", model, "latency", "--batch-size", "1",
                                "--input-len", str(n), "--output-len", str(n),
                                "--num-iters", "1" if sizes.dry_run else "5",
                                "--num-iters-warmup", "1", "--compare-hf",
                                "--profile", "--profile-batch-sizes", "1",
                                "--profile-input-len", str(n), "--num-kv-blocks", blocks)
            measured = [p["step_ms"] for p in doc.get("profile", []) if "step_ms" in p]
            est = decode_step(shape, 1, n, dtype)
            return {"ok": rc == 0 and bool(measured),
                    "measured_decode_step_ms": measured[0] if measured else None,
                    "h100_model_step_ms": 1e3 * est.step_split_s,
                    "h100_model_bound_ms": 1e3 * est.bound_s, "result": doc, "tail": tail}

        run.check(f"{name}_latency_batch1", latency)

        def throughput(name=name, model=model, blocks=blocks) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_throughput", model, "throughput", "--num-prompts",
                                str(sizes.bench_prompts), "--random-input-range", "1",
                                str(2 * n), "--random-output-range", "1", str(n),
                                "--ignore-eos", "--compare-hf", "--profile",
                                "--profile-batch-sizes", "1", "--profile-input-len", str(n),
                                "--num-kv-blocks", blocks)
            return {"ok": rc == 0 and bool(doc), "result": doc, "tail": tail}

        run.check(f"{name}_throughput_ragged", throughput)


# --------------------------------------------------------------------------- main

STAGE_FNS: dict[str, Callable[[StageRun], None]] = {
    "probe": stage_probe, "kernels": stage_kernels, "tiny": stage_tiny,
    "realshape": stage_realshape, "parity": stage_parity, "bench": stage_bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU: tiny shapes, the interpret backend, small time boxes")
    parser.add_argument("--out", default=None,
                        help="where STAGE.json goes (default: $OUT, else ./gpu_checks_out)")
    parser.add_argument("--time-box", type=float, default=None,
                        help=f"seconds after which no sub-check starts (default "
                             f"{DEFAULT_TIME_BOX_S:.0f}, {DRY_RUN_TIME_BOX_S:.0f} with --dry-run)")
    ns = parser.parse_args(argv)
    if ns.time_box is not None and ns.time_box <= 0:
        parser.error(f"--time-box must be > 0, got {ns.time_box}")
    # Engine cores in their own process and the bench and kernel-test children share the GPU
    # with this process: none may take most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = Path(ns.out or os.environ.get("OUT") or "gpu_checks_out")
    sizes = sizes_for(ns.dry_run, ns.time_box)
    run = StageRun(ns.stage, out, sizes)
    run.info = {"argv": sys.argv, "sizes": asdict(sizes), "started_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    run.write()
    STAGE_FNS[ns.stage](run)
    run.write()
    failed = run.failed()
    skipped = [c["name"] for c in run.checks if c["ok"] is None]
    print(f"[{ns.stage}] {len(run.checks) - len(failed) - len(skipped)} passed, "
          f"{len(failed)} failed {failed}, {len(skipped)} skipped (time box) -> {run.path}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
