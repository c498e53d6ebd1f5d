"""Our C++ CPU kernels (XLA FFI custom calls): built on first use with the machine's C++
compiler (`$CXX`, else g++/c++/clang++) for this CPU (`-march=native`), cached under
`$JAXLLM_CACHE_DIR/kernels` (default `~/.cache/jaxllm`) keyed by the source, flags, compiler,
jaxlib and CPU, then loaded. `$JAXLLM_CPU_KERNELS=0` (read once per process) turns them all off;
where one cannot be built (no compiler) its caller warns and runs XLA's own ops instead.

Builds per instruction set (`ISA_FLAGS`): `native` (the default) or `avx2` (`-march=x86-64-v3`:
AVX2 + FMA, which every AVX-512 machine runs too), chosen by `$JAXLLM_CPU_ISA` (read once per
process) or per call: the kernels' tiles follow the target's vector width and registers, so an
AVX-512 machine tests and times the AVX2 build as well. A build that is not the process's
default registers its FFI targets under names of its own (`target_name`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

DISABLE_ENV_VAR = "JAXLLM_CPU_KERNELS"
ISA_ENV_VAR = "JAXLLM_CPU_ISA"
HEADERS = Path(__file__).parent
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-march=x86-64-v3",)}
# What the CPU needs to run each build (/proc/cpuinfo's names; x86-64-v3's features).
_ISA_CPU_FLAGS = {"avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}}


def flags_for(march: tuple[str, ...]) -> tuple[str, ...]:
    """The compiler flags of every kernel for a target. Contraction off: the dequantization's
    multiply and add must round separately (gguf's float32 values exactly); the kernels'
    accumulations use explicit fma intrinsics."""
    return ("-O3", *march, "-ffp-contract=off", "-std=c++17", "-fPIC")


@functools.cache
def default_isa() -> str:
    """The process's build: $JAXLLM_CPU_ISA (read once), else "native"."""
    isa = os.environ.get(ISA_ENV_VAR) or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"${ISA_ENV_VAR}={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return isa


def runs_here(isa: str) -> bool:
    """Whether this CPU runs the `isa` build (native always)."""
    if isa == "native":
        return True
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in _cpu_identity().splitlines()
                  if ln.startswith("flags")), [])
    return _ISA_CPU_FLAGS[isa] <= set(flags)


def target_name(target: str, isa: str) -> str:
    """The FFI target name of `target` in the `isa` build: the plain name for the process's
    default build (the one the engine calls), suffixed for another."""
    return target if isa == default_isa() else f"{target}_{isa}"


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise KernelBuildError("no C++ compiler found (set $CXX, or install g++)")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def build(source: Path, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = (),
          isa: str = "native") -> Path:
    """The shared library of `source` for `isa` (ISA_FLAGS), compiled unless a cached build for
    this source/CPU/jaxlib/ISA (and `extra_flags`, e.g. a test's build without some instruction
    set) exists."""
    from jaxllm.model_executor.model_loader.default_model import cache_dir as jaxllm_cache

    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    # The kernels' shared headers sit beside this file: on the include path and in the key.
    headers = [h.read_text() for h in sorted(HEADERS.glob("*.h"))]
    flags = (*flags_for(ISA_FLAGS[isa]), "-shared", *extra_flags)
    key = hashlib.sha256("\0".join([
        source.read_text(), *headers, " ".join(flags), cxx, version,
        importlib.metadata.version("jaxlib"), _cpu_identity(),
    ]).encode()).hexdigest()[:16]
    out_dir = (cache_dir or jaxllm_cache() / "kernels")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{source.stem}-{isa}-{key}.so"
    if lib.exists():
        return lib
    # Compiled to a temporary name and renamed: processes building at once never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *flags, "-I", include, "-I", str(HEADERS), str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def enabled() -> bool:
    """False when $JAXLLM_CPU_KERNELS=0."""
    return os.environ.get(DISABLE_ENV_VAR, "1") != "0"


def resolve_isa(isa: str | None) -> str:
    """`isa`, or the process's default build ($JAXLLM_CPU_ISA, read once) for None."""
    if isa is None:
        return default_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"CPU kernel build {isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    return isa


def register(source: Path, targets: dict[str, str], fallback: str, isa: str) -> bool:
    """Builds and loads `source` for `isa` and registers its handler symbols with XLA's CPU
    backend as the FFI targets named (target name -> symbol; `target_name` of each for `isa`).
    False where disabled, or with a warning naming `fallback` (what runs instead) where it
    cannot be built or this CPU cannot run it."""
    if not enabled():
        return False
    try:
        if not runs_here(isa):
            raise KernelBuildError(f"this CPU cannot run the {isa} build")
        lib = ctypes.cdll.LoadLibrary(str(build(source, isa=isa)))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel %s unavailable (%s): %s", source.name, e, fallback)
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target_name(target, isa),
                                    jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True
