"""Compile every Pallas kernel to NVIDIA machine code with no GPU: registers, spills, occupancy.

check_lowering stops at Triton IR; this tool goes on to a cubin for each of its cases:

1. lower the case for CUDA as check_lowering does. Each Pallas kernel is a StableHLO custom call
   `__gpu$xla.gpu.triton` whose backend_config holds its name, grid, num_warps, num_stages and
   its Triton module as MLIR bytecode (the form jaxlib <= 0.10.2 emits without a GPU);
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
compiles with its own pinned Triton, not pip's, and Pallas lowers for compute capability 9.0 when
no GPU is present, whatever --arch says.

A case fails if it does not compile, does not fit an SM (0 resident blocks) or spills registers.
Failures listed in known_compile_failures.txt are tolerated; a listed case that no longer fails
that way is reported too, so the list can only shrink. Exit status 1 on a new failure or a stale
entry. Run: python -m pallas_kernels.check_compile [--arch sm_90a|sm_80] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.triton import dialect as tt_dialect

from pallas_kernels.check_lowering import (
    _TRITON_CALL,
    DTYPES,
    KERNEL_MODULES,
    MODEL_SHAPES,
    PHASES,
    ModelShape,
    _first_line,
    iter_cases,
)

KNOWN_FAILURES_PATH = Path(__file__).with_name("known_compile_failures.txt")


# --------------------------------------------------------------------------- occupancy


@dataclass(frozen=True)
class SMSpec:
    """Per-SM limits of one GPU, as the CUDA occupancy calculator uses them."""

    gpu: str
    capability: int  # Triton's GPUTarget arch: 90 compiles for sm_90a
    shared_per_sm: int  # bytes, at the largest shared-memory carveout
    shared_per_block: int  # bytes a block may opt in to, the reserve not included
    shared_reserve: int = 1024  # the driver's per-block reserve (sm_80 and later)
    shared_alloc_unit: int = 128
    regs_per_sm: int = 65536
    regs_per_block: int = 65536
    reg_alloc_unit: int = 256  # registers are allocated per warp, in units of 256
    sub_partitions: int = 4  # the register file is split between the SM's 4 schedulers
    max_regs_per_thread: int = 255
    max_warps: int = 64
    max_blocks: int = 32
    max_threads_per_block: int = 1024
    warp_size: int = 32


ARCHES: dict[str, SMSpec] = {
    "sm_90a": SMSpec("H100", 90, shared_per_sm=228 * 1024, shared_per_block=227 * 1024),
    "sm_80": SMSpec("A100", 80, shared_per_sm=164 * 1024, shared_per_block=163 * 1024),
}


@dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM (0: the block does not fit)
    warps: int  # resident warps per SM
    fraction: float  # warps / the SM's maximum
    limiter: str  # the binding limit(s): "regs", "shared", "warps", "blocks", joined by "+"
    by_limit: dict[str, int] = field(default_factory=dict)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def occupancy(sm: SMSpec, registers: int, num_warps: int, shared_bytes: int) -> Occupancy:
    """Resident blocks per SM for a block of `num_warps` warps, `registers` per thread and
    `shared_bytes` of shared memory (static + dynamic, without the driver's reserve)."""
    threads = num_warps * sm.warp_size
    # Registers: each warp gets registers*32 rounded up to the allocation unit; each of the
    # sub-partitions holds a whole number of warps. The hardware check assumes a block's warps
    # are spread over all sub-partitions.
    regs_per_warp = _round_up(registers * sm.warp_size, sm.reg_alloc_unit)
    if (registers > sm.max_regs_per_thread
            or regs_per_warp * _round_up(num_warps, sm.sub_partitions) > sm.regs_per_block):
        by_regs = 0
    elif regs_per_warp == 0:
        by_regs = sm.max_blocks
    else:
        warps_per_partition = (sm.regs_per_sm // sm.sub_partitions) // regs_per_warp
        by_regs = warps_per_partition * sm.sub_partitions // num_warps
    # Shared memory: the block's bytes plus the driver's reserve, in allocation units.
    shared = _round_up(shared_bytes + sm.shared_reserve, sm.shared_alloc_unit)
    if shared > sm.shared_per_block + sm.shared_reserve:
        by_shared = 0
    else:
        by_shared = sm.shared_per_sm // shared
    by_warps = sm.max_warps // num_warps if threads <= sm.max_threads_per_block else 0
    limits = {"regs": by_regs, "shared": by_shared, "warps": by_warps, "blocks": sm.max_blocks}
    blocks = min(limits.values())
    limiter = "+".join(name for name, n in limits.items() if n == blocks)
    warps = blocks * num_warps
    return Occupancy(blocks, warps, warps / sm.max_warps, limiter, limits)


# --------------------------------------------------------------------------- extraction


@dataclass(frozen=True)
class TritonKernel:
    """One `__gpu$xla.gpu.triton` custom call of a lowered module."""

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    ttir: str


_TRITON_CONTEXT: ir.Context | None = None


def _triton_context() -> ir.Context:
    """An MLIR context with the upstream dialects and jaxlib's Triton dialect, kept apart from
    JAX's own contexts."""
    global _TRITON_CONTEXT
    if _TRITON_CONTEXT is None:
        ctx = ir.Context()
        registry = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(registry)
        ctx.append_dialect_registry(registry)
        ctx.load_all_available_dialects()
        tt_dialect.register_dialect(ctx)
        _TRITON_CONTEXT = ctx
    return _TRITON_CONTEXT


def _custom_calls(op: ir.Operation) -> Iterable[ir.Operation]:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                child = child.operation
                if child.name == "stablehlo.custom_call":
                    yield child
                yield from _custom_calls(child)


def _int(attr: ir.Attribute) -> int:
    return ir.IntegerAttr(attr).value


def triton_kernels(fn, args: Sequence) -> list[TritonKernel]:
    """Lower `fn(*args)` for CUDA (no GPU) and return its Triton kernels as Triton IR text."""
    module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    kernels = []
    for call in _custom_calls(module.operation):
        attrs = call.attributes
        if ir.StringAttr(attrs["call_target_name"]).value != _TRITON_CALL:
            continue
        config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
        if not isinstance(config, ir.DictAttr):
            raise ValueError(f"{_TRITON_CALL} without a dictionary backend_config")
        ctx = _triton_context()
        with ctx:
            triton_module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=ctx)
            text = triton_module.operation.get_asm(enable_debug_info=False)
        kernels.append(TritonKernel(
            name=ir.StringAttr(config["name"]).value,
            grid=(_int(config["grid_x"]), _int(config["grid_y"]), _int(config["grid_z"])),
            num_warps=_int(config["num_warps"]),
            num_stages=_int(config["num_stages"]),
            ttir=text,
        ))
    return kernels


# --------------------------------------------------------------------------- compilation


@dataclass(frozen=True)
class CompileStats:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    static_shared: int = 0
    dynamic_shared: int = 0
    matmul: str = "-"
    seconds: float = 0.0
    error: str = ""


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_CUOBJDUMP = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """registers, stack, spill_stores, spill_loads from `ptxas -v` (one entry function)."""
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if regs is None or spills is None:
        raise ValueError(f"unexpected ptxas -v log: {log.strip()[:200]!r}")
    return {"registers": int(regs[1]), "stack": int(spills[1]),
            "spill_stores": int(spills[2]), "spill_loads": int(spills[3])}


def parse_resource_usage(text: str) -> dict[str, int]:
    """registers, stack, static_shared, local from `cuobjdump --dump-resource-usage`."""
    found = _CUOBJDUMP.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one function in cuobjdump's resource usage: {text!r}")
    regs, stack, shared, local = map(int, found[0])
    return {"registers": regs, "stack": stack, "static_shared": shared, "local": local}


def matmul_kind(ttir: str, ptx: str) -> str:
    """How the kernel's tt.dot ops run: "wgmma" or "mma" (tensor cores), "FMA", "-" (none)."""
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if re.search(r"\bmma\.sync\b", ptx):
        return "mma"
    return "FMA" if "tt.dot" in ttir else "-"


def compile_kernel(ttir: str, capability: int, num_warps: int, num_stages: int) -> CompileStats:
    """Triton IR text -> cubin with pip triton; never raises (the error is in the result)."""
    start = time.perf_counter()
    try:
        return _compile_kernel(ttir, capability, num_warps, num_stages, start)
    except Exception as exc:
        return CompileStats(seconds=time.perf_counter() - start, error=_first_line(exc))


def _compile_kernel(ttir: str, capability: int, num_warps: int, num_stages: int,
                    start: float) -> CompileStats:
    import triton
    from triton import knobs
    from triton._C.libtriton import ir as triton_ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", capability, 32)
    # fp fusion on, as XLA compiles; set explicitly (Triton 3.9 warns about its default).
    options = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": True}
    with tempfile.TemporaryDirectory(prefix="check_compile_") as tmp:
        raw = Path(tmp, "raw.ttir")
        raw.write_text(ttir)
        # triton.compile starts after the stage its source is in, so run make_ttir (XLA's
        # pipeline runs it too) here and hand it the result.
        backend = make_backend(target)
        context = triton_ir.context()
        triton_ir.load_dialects(context)
        backend.load_dialects(context)
        module = triton_ir.parse_mlir_module(str(raw), context)
        module.context = context
        module = backend.make_ttir(module, {}, backend.parse_options(dict(options)), capability)
        src = Path(tmp, "kernel.ttir")
        src.write_text(str(module))

        saved = (knobs.cache.dir, knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log)
        log = io.StringIO()
        try:
            # A private cache (nothing reused across runs) and ptxas -v's log on stdout.
            knobs.cache.dir = str(Path(tmp, "cache"))
            knobs.compilation.always_compile = True
            knobs.nvidia.dump_ptxas_log = True
            with contextlib.redirect_stdout(log):
                kernel = triton.compile(str(src), target=target, options=options)
        finally:
            knobs.cache.dir, knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
        ptxas = parse_ptxas_log(log.getvalue())

        cubin = Path(tmp, "kernel.cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        dump = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                              check=True, capture_output=True, text=True).stdout
        usage = parse_resource_usage(dump)
    if usage["registers"] != ptxas["registers"]:
        raise ValueError(f"ptxas says {ptxas['registers']} registers, cuobjdump "
                         f"{usage['registers']}")
    return CompileStats(
        registers=usage["registers"],
        spill_stores=ptxas["spill_stores"],
        spill_loads=ptxas["spill_loads"],
        stack=max(usage["stack"], ptxas["stack"]),
        static_shared=usage["static_shared"],
        dynamic_shared=int(kernel.metadata.shared),
        matmul=matmul_kind(ttir, kernel.asm["ptx"]),
        seconds=time.perf_counter() - start,
    )


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
    base = dict(module=case.module, kernel=name, model=case.model, dtype=case.dtype,
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
    models: Sequence[ModelShape] = MODEL_SHAPES,
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
                pending.append((case, None, case.kernel, f"lowering: {_first_line(exc)}"))
                continue
            if not kernels:
                pending.append((case, None, case.kernel, f"lowering: no {_TRITON_CALL} call"))
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
                    stats = compiled[key] = stats.result()
                except Exception as exc:  # a crashed worker
                    stats = compiled[key] = CompileStats(error=_first_line(exc))
            results.append(_result(case, arch, kernel, stats, name))
        return results
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=tuple(ARCHES), default="sm_90a",
                        help="target (default sm_90a, the one CI checks)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--modules", nargs="*", default=list(KERNEL_MODULES),
                        help="kernel modules to check (default: all)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compile processes (default: one per CPU)")
    parser.add_argument("--known", type=Path, default=KNOWN_FAILURES_PATH,
                        help="known-failures list (default: %(default)s)")
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
            "new_failures": [r.key for r in verdict.new],
            "stale_known_failures": [{"entry": e.line(), "now": now} for e, now in verdict.stale],
        }, indent=1))
    else:
        print(format_table(results, verdict.known))
        print()
        print(format_verdict(verdict, results, ns.arch, seconds, ns.known))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
