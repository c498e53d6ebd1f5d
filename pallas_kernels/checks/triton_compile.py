"""From a Pallas kernel's lowered Triton call to machine-code resource numbers, with no GPU:
the extraction (the `__gpu$xla.gpu.triton` custom calls of a lowered function, parsed back to
Triton IR with jaxlib's Triton dialect), the compilation (pip `triton`: make_ttir passes, then
TTGIR, PTX and a cubin, read with `ptxas -v` and `cuobjdump`), and the per-SM occupancy
estimate. check_compile.py runs this over every case and judges the results."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
from jaxlib.mlir import ir
from jaxlib.mlir._mlir_libs import _jax_mlir_ext
from jaxlib.triton import dialect as tt_dialect

from pallas_kernels.checks.check_lowering import TRITON_CALL, custom_calls, first_line
from pallas_kernels.common import lower_for_cuda

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


def _int(attr: ir.Attribute) -> int:
    return ir.IntegerAttr(attr).value


def triton_kernels(fn, args: Sequence) -> list[TritonKernel]:
    """Lower `fn(*args)` for CUDA (no GPU) and return its Triton kernels as Triton IR text."""
    return lowered_triton_kernels(lower_for_cuda(fn, args))


def lowered_triton_kernels(lowered: jax.stages.Lowered) -> list[TritonKernel]:
    """The Triton kernels of a program lowered for CUDA, as Triton IR text, one per call."""
    module = lowered.compiler_ir("stablehlo")
    assert module is not None, "a lowered computation has StableHLO"
    kernels = []
    for call in custom_calls(module.operation):
        attrs = call.attributes
        if ir.StringAttr(attrs["call_target_name"]).value != TRITON_CALL:
            continue
        config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
        if not isinstance(config, ir.DictAttr):
            raise ValueError(f"{TRITON_CALL} without a dictionary backend_config")
        ctx = _triton_context()
        with ctx:
            triton_module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=ctx)
            text = str(triton_module.operation.get_asm(enable_debug_info=False))
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
        return CompileStats(seconds=time.perf_counter() - start, error=first_line(exc))


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
        # The CUDA backend: make_ttir is not declared on triton's BaseBackend.
        backend: Any = make_backend(target)
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
                              check=True, capture_output=True, text=True, timeout=120).stdout
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
