"""Prove the Pallas -> Triton lowering of every kernel at Qwen2 shapes, with no GPU.

`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))` (`common.lower_for_cuda`, which
names the GPU to lower for) runs the whole Pallas -> Triton IR lowering on the host from abstract
`jax.ShapeDtypeStruct` arguments. It does not run Triton's own compiler (TTIR -> PTX happens when
XLA compiles on a GPU), so this catches unsupported primitives, non-power-of-two tiles and shape
errors, not register or shared-memory overflows.

The cases of each kernel module in KERNEL_MODULES are built by lowering_cases.py at the
shapes of MODEL_SHAPES (from shapes.py). Run: python -m pallas_kernels.checks.check_lowering
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxlib.mlir import ir

from pallas_kernels.checks.lowering_cases import LOWERING_CASES
from pallas_kernels.checks.shapes import QWEN2_SHAPES, Qwen2Shape
from pallas_kernels.common import lower_for_cuda

MODEL_SHAPES: tuple[Qwen2Shape, ...] = tuple(
    QWEN2_SHAPES[name] for name in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"))
DTYPES: tuple = (jnp.bfloat16, jnp.float32)
# decode: 64 sequences of one token each (context up to 4096), and for paged attention a
# speculative-decoding verify step (16 sequences of 6 tokens); decode1: one sequence of one
# token; prefill: 2048 tokens over 4 sequences. lowering_cases.py builds each kernel's args
# from these.
PHASES: tuple[str, ...] = ("decode", "decode1", "prefill")
KERNEL_MODULES: tuple[str, ...] = tuple(LOWERING_CASES)

# A Pallas Triton kernel appears in the lowered StableHLO as this custom call.
TRITON_CALL = "__gpu$xla.gpu.triton"


def custom_calls(op: ir.Operation) -> Iterable[ir.Operation]:
    """Every `stablehlo.custom_call` nested in `op` (a lowered module's operation)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                child = child.operation
                if child.name == "stablehlo.custom_call":
                    yield child
                yield from custom_calls(child)


@dataclass(frozen=True)
class TritonModules:
    """The distinct Triton modules of one lowered program, by kernel name. XLA compiles a
    `__gpu$xla.gpu.triton` call once per distinct backend_config (its Triton module, name,
    grid, warps and stages), so this is what a GPU start-up compiles for the program. `ops`:
    the custom call ops by kernel name (a kernel inside a jitted function is one op in the
    module however often that function is called)."""

    modules: dict[str, int]
    ops: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.modules.values())


def triton_modules(lowered: jax.stages.Lowered) -> TritonModules:
    """Count the distinct Triton modules and the Triton call ops of `lowered` (lowered for
    CUDA) by kernel name."""
    module = lowered.compiler_ir("stablehlo")
    assert module is not None, "a lowered computation has StableHLO"
    configs: dict[str, set[str]] = collections.defaultdict(set)
    ops: collections.Counter[str] = collections.Counter()
    for call in custom_calls(module.operation):
        attrs = call.attributes
        if ir.StringAttr(attrs["call_target_name"]).value != TRITON_CALL:
            continue
        if "mhlo.backend_config" not in attrs:
            raise ValueError(f"{TRITON_CALL} without a backend_config")
        config = attrs["mhlo.backend_config"]
        name = ir.StringAttr(ir.DictAttr(config)["name"]).value
        configs[name].add(str(config))
        ops[name] += 1
    return TritonModules({name: len(c) for name, c in configs.items()}, dict(ops))


@dataclass(frozen=True)
class Result:
    module: str
    kernel: str
    model: str
    dtype: str
    phase: str
    ok: bool
    error: str = ""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:200]


@dataclass(frozen=True)
class Case:
    """One lowering case; `fn(*args)` is None when its module or case builder failed (`error`)."""

    module: str
    kernel: str
    model: str
    dtype: str
    phase: str
    fn: Callable | None = None
    args: tuple = ()
    error: str = ""


def iter_cases(
    modules: Sequence[str] = KERNEL_MODULES,
    models: Sequence[Qwen2Shape] = MODEL_SHAPES,
    dtypes: Sequence = DTYPES,
    phases: Sequence[str] = PHASES,
) -> Iterator[Case]:
    """Every case of every module (check_compile walks the same list); failures are yielded."""
    for mod_name in modules:
        cases_fn = LOWERING_CASES.get(mod_name)
        if cases_fn is None:
            yield Case(mod_name, mod_name, "*", "*", "*",
                       error=f"missing: no lowering cases for kernel module {mod_name!r}; "
                             f"expected one of {KERNEL_MODULES}")
            continue
        for model in models:
            for dtype in dtypes:
                dname = jnp.dtype(dtype).name
                for phase in phases:
                    try:
                        cases = cases_fn(model, dtype, phase)
                    except Exception as exc:  # a broken case builder is a failure, not a crash
                        yield Case(mod_name, mod_name, model.name, dname, phase,
                                   error=first_line(exc))
                        continue
                    for kernel, fn, args in cases:
                        yield Case(mod_name, kernel, model.name, dname, phase, fn, tuple(args))


def run_checks(
    modules: Sequence[str] = KERNEL_MODULES,
    models: Sequence[Qwen2Shape] = MODEL_SHAPES,
    dtypes: Sequence = DTYPES,
    phases: Sequence[str] = PHASES,
) -> list[Result]:
    """Lower every case of every module; failures are recorded, never raised."""
    results: list[Result] = []
    for case in iter_cases(modules, models, dtypes, phases):
        ok, err = False, case.error
        if case.fn is not None:
            try:
                text = lower_for_cuda(case.fn, case.args).as_text()
                ok = TRITON_CALL in text
                err = "" if ok else "no Triton custom call in the lowered module"
            except Exception as exc:
                ok, err = False, first_line(exc)
        results.append(Result(case.module, case.kernel, case.model, case.dtype, case.phase, ok,
                              err))
    return results


def format_table(results: Sequence[Result]) -> str:
    header = ("kernel", "model", "dtype", "phase", "result")
    rows = [(r.kernel, r.model, r.dtype, r.phase, "ok" if r.ok else f"FAIL {r.error}")
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    widths[-1] = len(header[-1])  # the message column is not padded
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (header, *rows)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--modules", nargs="*", default=list(KERNEL_MODULES),
                        help="kernel modules to check (default: all)")
    ns = parser.parse_args(argv)
    results = run_checks(ns.modules)
    print(format_table(results))
    failed = sum(not r.ok for r in results)
    print(f"\n{len(results) - failed}/{len(results)} lowered for CUDA")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
