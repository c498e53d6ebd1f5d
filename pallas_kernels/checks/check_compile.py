"""Compile every Pallas kernel to NVIDIA machine code with no GPU: registers, spills, occupancy.

check_lowering stops at Triton IR; this tool goes on to a cubin for each of its cases:

1. lower the case for CUDA as check_lowering does. Each Pallas kernel is a StableHLO custom call
   `__gpu$xla.gpu.triton` whose backend_config holds its name, grid, num_warps, num_stages and
   its Triton module as MLIR bytecode (as jaxlib 0.10.2 to 0.11.2 emit it without a GPU);
2. parse that bytecode back to Triton IR text with jaxlib's Triton dialect;
3. compile it with pip `triton` (compile only, no GPU needed): Triton's make_ttir passes (XLA's
   Triton pipeline starts with the same ones), then `triton.compile` to TTGIR, PTX and a cubin,
   for sm_90a (H100) or sm_80 (A100);
4. read registers, spills and stack from the bundled `ptxas -v` log and
   `cuobjdump --dump-resource-usage`, shared memory from Triton (dynamic) and the cubin (static),
   and whether the kernel's `tt.dot`s became wgmma, mma (tensor cores) or FMA from the PTX.

From those it estimates resource occupancy per SM (registers in their per-warp allocation units
over the 4 sub-partitions, shared memory plus the driver's 1 KiB per-block reserve, at most 32
blocks and 64 warps): resource occupancy, not achieved occupancy. All numbers are estimates: XLA
compiles with its own pinned Triton, not pip's, and the lowering targets compute capability 9.0
(`common.LOWERING_DEVICE`), whatever --arch says.

A case fails if it does not compile, does not fit an SM (0 resident blocks) or spills registers.
Failures listed in known_compile_failures.txt are tolerated; a listed case that no longer fails
that way is reported too, so the list can only shrink. Exit status 1 on a new failure or a stale
entry. Run:
python -m pallas_kernels.checks.check_compile [--arch sm_90a|sm_80] [--json] [--model-time]

--model-time adds perf_model's H100 estimates (a model, not a measurement): per case the bytes,
FLOPs, roofline bound and what the compiled grid and occupancy suggest, then the Qwen2.5
decode-step estimate before and after split-K. The model needs the grids and blocks per SM, so
it runs after the compile (its own cost is negligible).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pallas_kernels.checks import perf_model
from pallas_kernels.checks.check_lowering import (
    DTYPES,
    KERNEL_MODULES,
    MODEL_SHAPES,
    PHASES,
    TRITON_CALL,
    first_line,
    iter_cases,
)
from pallas_kernels.checks.shapes import Qwen2Shape
from pallas_kernels.checks.triton_compile import (
    ARCHES,
    CompileStats,
    TritonKernel,
    compile_kernel,
    occupancy,
    triton_kernels,
)

# One kernel compiles in ~1-10 s here; far past that, a worker is stuck, never worth waiting on.
COMPILE_TIMEOUT_S = 300

KNOWN_FAILURES_PATH = Path(__file__).with_name("known_compile_failures.txt")


# --------------------------------------------------------------------------- checking


@dataclass(frozen=True)
class Result:
    module: str
    kernel: str
    model: str
    dtype: str
    phase: str
    arch: str
    grid: tuple[int, int, int] = (0, 0, 0)
    num_warps: int = 0
    num_stages: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0  # bytes per block, without the driver's 1 KiB reserve
    static_shared: int = 0  # as cuobjdump reports it (on sm_90a: the reserve)
    dynamic_shared: int = 0  # as Triton allocates it
    blocks_per_sm: int = 0
    occupancy: float = 0.0
    limiter: str = ""
    matmul: str = "-"
    compile_seconds: float = 0.0
    error: str = ""

    @property
    def key(self) -> str:
        return f"{self.kernel} {self.model} {self.dtype} {self.phase}"

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def status(self) -> str:
        """"compile" (failed to lower or compile), "no-fit", "spills" or "ok"."""
        if self.error:
            return "compile"
        if self.blocks_per_sm == 0:
            return "no-fit"
        return "spills" if self.spill_bytes else "ok"


def _result(case, arch: str, kernel: TritonKernel | None, stats: CompileStats | None,
            name: str, error: str = "") -> Result:
    base: dict[str, Any] = dict(module=case.module, kernel=name, model=case.model, dtype=case.dtype,
                phase=case.phase, arch=arch)
    if kernel is None or stats is None:
        return Result(**base, error=error)
    if stats.error:
        return Result(**base, grid=kernel.grid, num_warps=kernel.num_warps,
                      num_stages=kernel.num_stages, compile_seconds=stats.seconds,
                      error=stats.error)
    sm = ARCHES[arch]
    shared = stats.static_shared + stats.dynamic_shared
    if sm.capability >= 90:
        # Triton declares no static shared memory. For sm_90 ptxas puts the driver's per-block
        # reserve into the cubin as 1 KiB of static shared memory (the kernel addresses its
        # dynamic shared memory from 0x400); occupancy() adds the reserve, so take it out here.
        shared -= min(stats.static_shared, sm.shared_reserve)
    occ = occupancy(sm, stats.registers, kernel.num_warps, shared)
    return Result(**base, grid=kernel.grid, num_warps=kernel.num_warps,
                  num_stages=kernel.num_stages, registers=stats.registers,
                  spill_stores=stats.spill_stores, spill_loads=stats.spill_loads,
                  stack=stats.stack, shared=shared, static_shared=stats.static_shared,
                  dynamic_shared=stats.dynamic_shared, blocks_per_sm=occ.blocks,
                  occupancy=occ.fraction, limiter=occ.limiter, matmul=stats.matmul,
                  compile_seconds=stats.seconds)


def run_checks(
    arch: str = "sm_90a",
    modules: Sequence[str] = KERNEL_MODULES,
    models: Sequence[Qwen2Shape] = MODEL_SHAPES,
    dtypes: Sequence = DTYPES,
    phases: Sequence[str] = PHASES,
    jobs: int | None = None,
) -> list[Result]:
    """Lower and compile every case; failures are recorded, never raised.

    Lowering runs here; compiling runs in `jobs` worker processes (default: one per CPU; 1
    compiles in this process). A Triton module that occurs twice with the same launch options
    is compiled once.
    """
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {tuple(ARCHES)}")
    capability = ARCHES[arch].capability
    jobs = max(1, jobs if jobs is not None else (os.cpu_count() or 1))
    pool = None
    if jobs > 1:
        pool = concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn"))
    hung = False
    compiled: dict[tuple, concurrent.futures.Future | CompileStats] = {}
    pending: list[tuple] = []  # (case, kernel, name, key) or (case, None, name, error)
    try:
        for case in iter_cases(modules, models, dtypes, phases):
            if case.fn is None:
                pending.append((case, None, case.kernel, f"lowering: {case.error}"))
                continue
            try:
                kernels = triton_kernels(case.fn, case.args)
            except Exception as exc:
                pending.append((case, None, case.kernel, f"lowering: {first_line(exc)}"))
                continue
            if not kernels:
                pending.append((case, None, case.kernel, f"lowering: no {TRITON_CALL} call"))
            for kernel in kernels:
                name = case.kernel if len(kernels) == 1 else f"{case.kernel}/{kernel.name}"
                key = (kernel.ttir, kernel.num_warps, kernel.num_stages)
                if key not in compiled:
                    args = (kernel.ttir, capability, kernel.num_warps, kernel.num_stages)
                    compiled[key] = (pool.submit(compile_kernel, *args) if pool
                                     else compile_kernel(*args))
                pending.append((case, kernel, name, key))
        results = []
        for case, kernel, name, key in pending:
            if kernel is None:
                results.append(_result(case, arch, None, None, name, error=key))
                continue
            stats = compiled[key]
            if isinstance(stats, concurrent.futures.Future):
                try:
                    stats = compiled[key] = stats.result(timeout=COMPILE_TIMEOUT_S)
                except concurrent.futures.TimeoutError:
                    hung = True
                    stats = compiled[key] = CompileStats(
                        error=f"no result within {COMPILE_TIMEOUT_S} s")
                except Exception as exc:  # a crashed worker
                    stats = compiled[key] = CompileStats(error=first_line(exc))
            results.append(_result(case, arch, kernel, stats, name))
        return results
    finally:
        if pool is not None:
            if hung:
                # A hung compile would block shutdown forever: end the workers instead.
                for proc in list(getattr(pool, "_processes", {}).values()):
                    proc.kill()
            pool.shutdown(wait=not hung, cancel_futures=True)


# --------------------------------------------------------------------------- known failures


@dataclass(frozen=True)
class KnownFailure:
    arch: str
    kernel: str
    model: str
    dtype: str
    phase: str
    status: str

    @property
    def key(self) -> str:
        return f"{self.kernel} {self.model} {self.dtype} {self.phase}"

    def line(self) -> str:
        return f"{self.arch} {self.key} {self.status}"


def load_known_failures(path: Path = KNOWN_FAILURES_PATH) -> list[KnownFailure]:
    """`arch kernel model dtype phase status` per line; '#' starts a comment."""
    entries = []
    for num, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 6 or fields[0] not in ARCHES or fields[5] not in (
                "compile", "no-fit", "spills"):
            raise ValueError(f"{path}:{num}: expected 'arch kernel model dtype phase status' "
                             f"(status compile, no-fit or spills), got {raw!r}")
        entries.append(KnownFailure(*fields))
    return entries


@dataclass(frozen=True)
class Verdict:
    new: list[Result]  # failing and not listed (or listed with another status)
    known: list[Result]  # failing as listed
    stale: list[tuple[KnownFailure, str]]  # listed, but the case now has this status (or is gone)

    @property
    def ok(self) -> bool:
        return not self.new and not self.stale


def judge(results: Sequence[Result], known: Sequence[KnownFailure],
          complete: bool = True) -> Verdict:
    """Sort the results against the known failures of their arch. `complete`: every case ran,
    so a listed case with no result is stale too (otherwise only listed kernels that ran)."""
    arches = {r.arch for r in results}
    listed = {(k.arch, k.key): k for k in known if k.arch in arches}
    by_key = {(r.arch, r.key): r for r in results}
    ran_kernels = {(r.arch, r.kernel) for r in results}
    new, hits, stale = [], [], []
    for r in results:
        if r.status == "ok":
            continue
        entry = listed.get((r.arch, r.key))
        (hits if entry is not None and entry.status == r.status else new).append(r)
    for (arch, key), entry in listed.items():
        r = by_key.get((arch, key))
        if r is None:
            if complete or (arch, entry.kernel) in ran_kernels:
                stale.append((entry, "no such case"))
        elif r.status != entry.status:
            stale.append((entry, r.status))
    return Verdict(new, hits, stale)


# --------------------------------------------------------------------------- output


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}K" if n >= 1024 else f"{n}B" if n else "0"


def format_table(results: Sequence[Result], known: Sequence[Result] = ()) -> str:
    """One row per result; failures in `known` are marked so."""
    header = ("kernel", "model", "dtype", "phase", "grid", "warps", "stages", "regs", "spill st/ld",
              "stack", "smem", "blocks/SM", "occupancy", "matmul", "result")
    rows = []
    for r in results:
        if r.error:
            grid = "x".join(map(str, r.grid)) if r.num_warps else ""
            rows.append((r.kernel, r.model, r.dtype, r.phase, grid, "", "", "", "", "", "", "",
                         "", "", f"FAIL{' (known)' if r in known else ''} {r.error}"))
            continue
        rows.append((
            r.kernel, r.model, r.dtype, r.phase, "x".join(map(str, r.grid)), str(r.num_warps),
            str(r.num_stages), str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
            str(r.stack), _kib(r.shared), str(r.blocks_per_sm),
            f"{r.occupancy:.0%} {r.limiter}", r.matmul,
            f"{r.status} (known)" if r in known else r.status))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    widths[-1] = len(header[-1])  # the message column is not padded
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in (header, *rows))


def format_verdict(verdict: Verdict, results: Sequence[Result], arch: str, seconds: float,
                   known_path: Path) -> str:
    sm = ARCHES[arch]
    ok = sum(r.status == "ok" for r in results)
    lines = [f"{len(results)} kernels for {arch} (occupancy estimated on an {sm.gpu}) in "
             f"{seconds:.1f} s: {ok} ok, {len(verdict.known)} known failures, "
             f"{len(verdict.new)} new, {len(verdict.stale)} stale list entries"]
    lines += [f"NEW FAILURE ({r.status}): {r.key}" + (f": {r.error}" if r.error else "")
              for r in verdict.new]
    lines += [f"STALE: '{entry.line()}' is now {now}; remove it from {known_path.name}"
              for entry, now in verdict.stale]
    return "\n".join(lines)


def model_rows(results: Sequence[Result]) -> list[tuple[str, str, str, str,
                                                        perf_model.CaseModel]]:
    """perf_model's estimate for every compiled case (failed ones have no grid: skipped)."""
    shapes = {m.name: m for m in MODEL_SHAPES}
    return [(r.kernel, r.model, r.dtype, r.phase,
             perf_model.case_model(r.kernel, shapes[r.model], r.dtype, r.phase, r.grid,
                                   r.num_warps, r.blocks_per_sm))
            for r in results if not r.error and r.model in shapes]


def format_model_time(results: Sequence[Result]) -> str:
    pm = perf_model
    return "\n".join([
        f"Per-kernel model on an H100 SXM: MODEL, NOT MEASUREMENT (HBM "
        f"{pm.HBM_BYTES_PER_S / 1e12:.2f} TB/s; {pm.BF16_TENSOR_FLOPS / 1e12:.0f} TFLOP/s bf16 "
        f"dots, {pm.FP32_FLOPS / 1e12:.0f} TFLOP/s FP32; {pm.NUM_SMS} SMs; floor "
        f"{pm.FLOOR_US:g} us). decode: 64 sequences x {pm.CASE_DECODE_CONTEXT} keys; verify: "
        f"{pm.VERIFY_SEQS} x {pm.VERIFY_QUERY_LEN} tokens on "
        f"{pm.CASE_DECODE_CONTEXT - pm.VERIFY_QUERY_LEN} cached keys; prefill: 4 x 512 tokens. "
        "programs: working/launched.",
        pm.format_case_models(model_rows(results)),
        "",
        "Decode step, bfloat16 (model, not measurement; "
        "python -m pallas_kernels.checks.perf_model):",
        pm.format_steps(pm.default_steps()),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--arch", choices=tuple(ARCHES), default="sm_90a",
                        help="target (default sm_90a, the one CI checks)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--modules", nargs="*", default=list(KERNEL_MODULES),
                        help="kernel modules to check (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile processes (default: one per CPU)")
    parser.add_argument("--known", type=Path, default=KNOWN_FAILURES_PATH,
                        help="known-failures list (default: %(default)s)")
    parser.add_argument("--model-time", action="store_true",
                        help="also print perf_model's H100 time estimates (a model)")
    ns = parser.parse_args(argv)
    known = load_known_failures(ns.known)
    start = time.perf_counter()
    results = run_checks(ns.arch, ns.modules, jobs=ns.jobs)
    seconds = time.perf_counter() - start
    verdict = judge(results, known, complete=set(ns.modules) >= set(KERNEL_MODULES))
    if ns.json:
        print(json.dumps({
            "arch": ns.arch,
            "gpu": ARCHES[ns.arch].gpu,
            "seconds": round(seconds, 1),
            "ok": verdict.ok,
            "results": [{**asdict(r), "status": r.status, "known": r in verdict.known}
                        for r in results],
            **({"model": [{"kernel": k, "model": m, "dtype": d, "phase": p,
                           "bytes": c.cost.bytes, "flops": c.cost.flops,
                           "bound_us": c.cost.bound_s * 1e6, "model_us": c.time_s * 1e6,
                           "programs": c.cost.programs or c.launched, "note": c.note}
                          for k, m, d, p, c in model_rows(results)]}
               if ns.model_time else {}),
            "new_failures": [r.key for r in verdict.new],
            "stale_known_failures": [{"entry": e.line(), "now": now} for e, now in verdict.stale],
        }, indent=1))
    else:
        print(format_table(results, verdict.known))
        print()
        print(format_verdict(verdict, results, ns.arch, seconds, ns.known))
        if ns.model_time:
            print()
            print(format_model_time(results))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
