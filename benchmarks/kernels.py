"""Microbenchmark of the kernels at Qwen2.5-0.5B shapes: time, bytes moved, bandwidth.

    python benchmarks/kernels.py [--json PATH] [--peak-gbps N] [--runs N] [--kernels ...]

Each kernel's public function is jitted with backend "pallas" on a GPU ("interpret" on CPU) and
"reference", timed as the median of --runs calls after warm-up (block_until_ready). Bytes moved
counts what the op must read and write at least once (inputs + outputs, the touched part of the
KV cache only), so GB/s is an effective bandwidth and "%peak" its fraction of the device's:
a GPU's HBM peak from a table by device kind (or --peak-gbps), on CPU a measured numpy copy.
CPU numbers of the "interpret" backend measure Pallas' interpreter, not the kernel's design.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Run as a script, Python puts benchmarks/ on the path: add the repo root so that this
# checkout's pallas_kernels is the one imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.checks.shapes import QWEN2_SHAPES
from pallas_kernels.dequant_matmul import dequant_matmul
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope, rope_cos_sin_cache

# HBM bandwidth in GB/s by a substring of jax's device_kind (datasheet figures, SXM parts).
GPU_PEAK_GBPS: dict[str, float] = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}

MODEL = QWEN2_SHAPES["qwen2.5-0.5b"]
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = (
    MODEL.hidden_size, MODEL.num_heads, MODEL.num_kv_heads, MODEL.head_dim,
    MODEL.intermediate_size)
# GGUF block layout of the dequant matmul cases (Q4_K-like: 32 values, scale and offset).
GGUF_GROUP = 32
ROPE_THETA, EPS, BLOCK_SIZE = 1_000_000.0, 1e-6, 16


@dataclass
class BenchResult:
    kernel: str
    phase: str
    backend: str
    shape: str
    time_ms: float | None
    bytes_moved: int
    gbps: float | None
    frac_peak: float | None
    error: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    num_seqs: int
    query_len: int  # tokens per sequence this step
    context_len: int  # keys per sequence, this step's tokens included

    @property
    def tokens(self) -> int:
        return self.num_seqs * self.query_len


def default_phases(on_gpu: bool) -> tuple[Phase, ...]:
    if on_gpu:
        return (Phase("decode", 64, 1, 4096), Phase("prefill", 4, 512, 512))
    # Interpret mode on a 2-core CPU: smaller batches keep the whole run near a minute.
    return (Phase("decode", 16, 1, 512), Phase("prefill", 2, 128, 128))


# --------------------------------------------------------------------------- cases

# A case: (kernel name, fn(backend) -> jitted callable, args, bytes moved, donate_first).
# With donate_first the callable's first argument is donated and its result is fed back as the
# next call's first argument (the KV cache, updated in place as in the engine).
Case = tuple[str, Callable[[str], Callable], tuple, int, bool]


def _nbytes(*arrays) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in arrays))


def _rng_array(key: int, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _cases(phase: Phase, dtype) -> list[Case]:
    t = phase.tokens
    x = _rng_array(0, (t, HIDDEN), dtype)
    res = _rng_array(1, (t, HIDDEN), dtype)
    w = _rng_array(2, (HIDDEN,), dtype)
    q = _rng_array(3, (t, NUM_HEADS, HEAD_DIM), dtype)
    k = _rng_array(4, (t, NUM_KV_HEADS, HEAD_DIM), dtype)
    v = _rng_array(5, (t, NUM_KV_HEADS, HEAD_DIM), dtype)
    positions = (jnp.arange(t, dtype=jnp.int32) % phase.query_len
                 + (phase.context_len - phase.query_len))
    cache = rope_cos_sin_cache(HEAD_DIM, max(phase.context_len, 1), ROPE_THETA, dtype)
    cs_bytes = t * HEAD_DIM * cache.dtype.itemsize  # one cache row per token

    cases: list[Case] = [
        ("rms_norm",
         lambda b: jax.jit(lambda x, w: rms_norm(x, w, EPS, backend=b)),
         (x, w), 2 * _nbytes(x) + _nbytes(w), False),
        ("rms_norm+residual",
         lambda b: jax.jit(lambda x, r, w: rms_norm(x, w, EPS, r, backend=b)),
         (x, res, w), 4 * _nbytes(x) + _nbytes(w), False),
        ("rope",
         lambda b: jax.jit(lambda q, k, p, c: rope(q, k, p, c, backend=b)),
         (q, k, positions, cache), 2 * _nbytes(q, k) + _nbytes(positions) + cs_bytes, False),
    ]
    cases += _paged_cases(phase, dtype, q, k, v)
    cases += _dequant_cases(phase, dtype)
    return cases


def _dequant_cases(phase: Phase, dtype) -> list[Case]:
    """The fused gate_up matmul on GGUF int8 blocks: the step's rows, and one row (the GEMV)."""
    n, k = 2 * INTERMEDIATE, HIDDEN
    qweight = jax.random.randint(jax.random.key(6), (n, k), -128, 128, jnp.int8)
    scale = _rng_array(7, (n, k // GGUF_GROUP), jnp.float32) * 1e-3
    offset = _rng_array(8, (n, k // GGUF_GROUP), jnp.float32) * 1e-3

    def make(b):
        return jax.jit(lambda x, q, s, o: dequant_matmul(x, q, s, o, backend=b))

    cases = []
    # "_m1": one row whatever the phase's token count (the shape column shows the phase's).
    for name, rows in (("dequant_matmul", phase.tokens), ("dequant_gemv_m1", 1)):
        if rows == 1 and phase.name != "decode":
            continue
        x = _rng_array(9, (rows, k), dtype)
        nbytes = _nbytes(qweight, scale, offset) + rows * (k + n) * jnp.dtype(dtype).itemsize
        cases.append((name, make, (x, qweight, scale, offset), nbytes, False))
    return cases


def _paged_cases(phase: Phase, dtype, q, k, v) -> list[Case]:
    """write_kv and paged_attention, on a one-layer cache."""
    blocks_per_seq = -(-phase.context_len // BLOCK_SIZE)
    num_blocks = phase.num_seqs * blocks_per_seq + 1
    kv_cache = jnp.zeros((1, 2, NUM_KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM), dtype)
    # Shuffled physical blocks, as after the pool has been in use for a while.
    perm = np.random.default_rng(0).permutation(num_blocks - 1)
    block_tables = jnp.asarray(perm.reshape(phase.num_seqs, blocks_per_seq), jnp.int32)
    seq_lens = jnp.full((phase.num_seqs,), phase.context_len, jnp.int32)
    qsl = jnp.arange(phase.num_seqs + 1, dtype=jnp.int32) * phase.query_len
    # This step's tokens are the last query_len positions of each sequence.
    pos = np.arange(phase.context_len - phase.query_len, phase.context_len)
    slots = (np.asarray(block_tables)[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    slot_mapping = jnp.asarray(slots.reshape(-1), jnp.int32)
    kv_bytes = 2 * phase.num_seqs * phase.context_len * NUM_KV_HEADS * HEAD_DIM
    kv_bytes *= jnp.dtype(dtype).itemsize

    scale = HEAD_DIM ** -0.5

    def make_write(b):
        return jax.jit(lambda c, k, v, s: write_kv(c, 0, k, v, s, backend=b), donate_argnums=0)

    def make_attn(b):
        return jax.jit(lambda q, c, bt, sl, qs: paged_attention(
            q, c, 0, bt, sl, qs, scale=scale, max_query_len=phase.query_len, backend=b))

    return [
        # Read K, V and slots, write the same K/V bytes into the cache.
        ("write_kv", make_write, (kv_cache, k, v, slot_mapping),
         2 * _nbytes(k, v) + _nbytes(slot_mapping), True),
        ("paged_attention", make_attn, (q, kv_cache, block_tables, seq_lens, qsl),
         2 * _nbytes(q) + kv_bytes + _nbytes(block_tables, seq_lens, qsl), False),
    ]


# --------------------------------------------------------------------------- timing


def time_call(fn: Callable, args: tuple, runs: int, warmup: int, donate_first: bool) -> float:
    """Median seconds of fn(*args) over `runs` calls after `warmup` (compile included there)."""
    args = list(args)
    if donate_first:
        args[0] = jnp.array(args[0], copy=True)  # never donate the caller's array

    def call():
        out = fn(*args)
        jax.block_until_ready(out)
        if donate_first:
            args[0] = out
        return out

    for _ in range(warmup):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_copy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best-of-`repeats` numpy copy bandwidth, counting the read and the write."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def device_peak_gbps(override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "--peak-gbps"
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        for key, gbps in GPU_PEAK_GBPS.items():
            if key in dev.device_kind:
                return gbps, f"{dev.device_kind} datasheet"
        return None, f"{dev.device_kind}: unknown, pass --peak-gbps"
    return cpu_copy_gbps(), "numpy copy (read+write), measured"


# --------------------------------------------------------------------------- main


def run_bench(runs: int, warmup: int, peak: float | None, dtype=None,
              phases: Sequence[Phase] | None = None,
              kernels: Sequence[str] | None = None) -> list[BenchResult]:
    on_gpu = jax.default_backend() == "gpu"
    kernel_backend = "pallas" if on_gpu else "interpret"
    # bfloat16 on GPU (what the engine runs); float32 on CPU, where XLA's bf16 is ~20x slower.
    dtype = dtype or (jnp.bfloat16 if on_gpu else jnp.float32)
    results = []
    for phase in phases or default_phases(on_gpu):
        for name, make, args, nbytes, donate in _cases(phase, dtype):
            if kernels and name not in kernels:
                continue
            shape = f"T={phase.tokens} S={phase.num_seqs} ctx={phase.context_len}"
            for backend in (kernel_backend, "reference"):
                try:
                    sec = time_call(make(backend), args, runs, warmup, donate)
                    gbps = nbytes / sec / 1e9
                    results.append(BenchResult(name, phase.name, backend, shape, sec * 1e3,
                                               nbytes, gbps, gbps / peak if peak else None))
                except Exception as exc:  # one broken kernel must not hide the others
                    msg = (str(exc).strip().splitlines() or [""])[0][:120]
                    results.append(BenchResult(name, phase.name, backend, shape, None, nbytes,
                                               None, None, f"{type(exc).__name__}: {msg}"))
    return results


def format_results(results: Sequence[BenchResult]) -> str:
    header = ("kernel", "phase", "backend", "shape", "ms", "MB", "GB/s", "%peak")
    rows = []
    for r in results:
        if r.error:
            rows.append((r.kernel, r.phase, r.backend, r.shape, "ERROR " + r.error, "", "", ""))
            continue
        rows.append((r.kernel, r.phase, r.backend, r.shape, f"{r.time_ms:.3f}",
                     f"{r.bytes_moved / 1e6:.2f}", f"{r.gbps:.2f}",
                     "-" if r.frac_peak is None else f"{100 * r.frac_peak:.1f}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None,
                        help="timed calls per case (default 50 on GPU, 5 on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device bandwidth for %%peak (default: table on GPU, copy on CPU)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    parser.add_argument("--kernels", nargs="*", default=None, help="only these kernels")
    parser.add_argument("--json", metavar="PATH", default=None, help="write results as JSON")
    ns = parser.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    runs = ns.runs or (50 if on_gpu else 5)
    peak, peak_src = device_peak_gbps(ns.peak_gbps)
    dev = jax.devices()[0]
    print(f"device: {dev.platform} {dev.device_kind}; peak "
          f"{'n/a' if peak is None else f'{peak:.1f} GB/s'} ({peak_src}); runs={runs}")
    results = run_bench(runs, ns.warmup, peak, jnp.dtype(ns.dtype) if ns.dtype else None,
                        kernels=ns.kernels)
    print(format_results(results))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": f"{dev.platform} {dev.device_kind}", "peak_gbps": peak,
                       "peak_source": peak_src, "runs": runs,
                       "results": [asdict(r) for r in results]}, f, indent=2)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
