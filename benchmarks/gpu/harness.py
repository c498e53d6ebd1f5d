"""What every stage of the GPU check suite shares: its sizes (a GPU's or a dry run's), its
record (StageRun, written out after each sub-check under a time box) and the measuring and
comparing helpers."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("probe", "kernels", "tiny", "realshape", "parity", "bench")
# A lent GPU runs one command for at most 10 minutes: a stage leaves a minute for the rest.
DEFAULT_TIME_BOX_S = 540.0
DRY_RUN_TIME_BOX_S = 300.0
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "torch", "transformers", "triton", "flax", "numpy")


@dataclass(frozen=True)
class Sizes:
    """Everything a stage sizes itself by: the GPU's real sizes, or tiny ones for --dry-run."""

    dry_run: bool
    kernel_backend: str  # the Pallas backend under test: pallas (GPU) or interpret (CPU)
    # The engines' backend in the tiny and parity stages: pallas, or reference on CPU (whose
    # step buckets must update the KV array in place, which interpret mode's loops do not)
    engine_backend: str
    time_box_s: float
    copy_bytes: int
    gemm_n: int
    kernel_tests: tuple[str, ...]
    kernel_bench_args: tuple[str, ...]
    tiny_vocab: int
    tiny_max_model_len: int
    tiny_new_tokens: int
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
        return Sizes(True, "interpret", "reference",
                     time_box_s or DRY_RUN_TIME_BOX_S,
                     copy_bytes=8 << 20, gemm_n=256,
                     kernel_tests=("tests/kernels/test_rms_norm.py",),
                     kernel_bench_args=("--runs", "1", "--warmup", "1", "--kernels", "rms_norm"),
                     tiny_vocab=128, tiny_max_model_len=128, tiny_new_tokens=12,
                     split_k_max_model_len=512,
                     realshapes=("dry-run-tiny",), realshape_tokens=16, realshape_seqs=2,
                     parity_model="tiny-qwen2", parity_prompts=2,
                     bench_models=("dry-run-tiny",), bench_batch_sizes=(1, 2), bench_len=4,
                     bench_prompts=3, bench_tokens=16, parity_new_tokens=8)
    return Sizes(False, "pallas", "pallas", time_box_s or DEFAULT_TIME_BOX_S,
                 copy_bytes=2 << 30, gemm_n=8192, kernel_tests=("tests/kernels",),
                 kernel_bench_args=(), tiny_vocab=512, tiny_max_model_len=128,
                 tiny_new_tokens=24,
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


def run_recorded(stage: str, fn: Callable[[StageRun], None], out: Path, sizes: Sizes) -> list[str]:
    """Run `fn` as stage `stage`, writing out/STAGE.json; returns its failed sub-checks' names.
    A raise outside any sub-check is recorded as the failed check `stage_error`."""
    import sys
    from dataclasses import asdict

    run = StageRun(stage, out, sizes)
    run.info = {"argv": sys.argv, "sizes": asdict(sizes), "started_utc": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    run.write()
    try:
        fn(run)
    except Exception as exc:
        # Outside any sub-check: record it, and let the stages after this one run.
        run.checks.append({"name": "stage_error", "ok": False,
                           "error": f"{type(exc).__name__}: {exc}"[:2000],
                           "traceback": traceback.format_exc()[-4000:]})
        print(run.checks[-1]["traceback"], flush=True)
    run.write()
    failed = run.failed()
    skipped = [c["name"] for c in run.checks if c["ok"] is None]
    print(f"[{stage}] {len(run.checks) - len(failed) - len(skipped)} passed, "
          f"{len(failed)} failed {failed}, {len(skipped)} skipped (time box) -> {run.path}",
          flush=True)
    return failed


# --------------------------------------------------------------------------- helpers


def _json_value(value: Any) -> Any:
    """numpy scalars and arrays as JSON numbers and lists; anything else as its str()."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def jax_module():
    import jax

    return jax


def platform_check(sizes: Sizes) -> dict[str, Any]:
    """A real run on anything but a GPU is a failure, never a silent CPU fallback."""
    jax = jax_module()
    backend = jax.default_backend()
    return {"ok": sizes.dry_run or backend == "gpu", "backend": backend,
            "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()]}


def median_seconds(fn: Callable[[], Any], runs: int, warmup: int = 2) -> float:
    jax = jax_module()
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
    jax = jax_module()
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # one read and one write of every element
    return 2 * nbytes / median_seconds(lambda: copy(x), runs=10) / 1e9


def measure_gemm_tflops(n: int) -> float:
    jax = jax_module()
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


def greedy_ids(llm, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None):
    from jaxllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def kv_pool_check(llm) -> dict[str, Any]:
    """The engine's KV pool all free and no request left (tests.utils.scheduler_state)."""
    from tests.utils import scheduler_state

    state = scheduler_state(llm)
    free, usable = state["num_free_blocks"], state["num_usable_blocks"]
    return {"ok": free == usable and state["num_requests"] == 0, "free_blocks": free,
            "usable_blocks": usable, "requests": state["num_requests"]}


def top_k_close(a_out, b_out) -> dict[str, Any]:
    """tests.utils.check_logprobs_close over two engines' outputs (each side's greedy token,
    where the sequences first differ, within the other side's top-k)."""
    from tests.utils import check_logprobs_close

    a = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in a_out]
    b = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in b_out]
    diverged = compared = 0
    for (ta, _), (tb, _) in zip(a, b, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False))
                      if x != y), None)
        diverged += first is not None
        # Positions up to and including the first divergence: past it the contexts differ.
        compared += min(len(ta), len(tb)) if first is None else first + 1
    counts = {"sequences": len(a), "sequences_diverged": diverged,
              "positions_compared": compared}
    try:
        check_logprobs_close(a, b, name_a="float32", name_b="bfloat16")
    except AssertionError as exc:
        return {"ok": False, **counts, "not_in_top_k": str(exc)[:2000]}
    return {"ok": True, **counts}


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
