"""Our C++ CPU kernels (XLA FFI custom calls): built on first use with the machine's C++
compiler (`$CXX`, else g++/c++/clang++) for this CPU (`-march=native`), cached under
`$JAXLLM_CACHE_DIR/kernels` (default `~/.cache/jaxllm`) keyed by the source, flags, compiler,
jaxlib and CPU, then loaded. `$JAXLLM_CPU_KERNELS=0` (read once per process) turns them all off;
where one cannot be built (no compiler) its caller warns and runs XLA's own ops instead.
"""

from __future__ import annotations

import ctypes
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
_HEADERS = Path(__file__).parent
# One set of flags for every kernel. Contraction off: the dequantization's multiply and add must
# round separately (gguf's float32 values exactly); the kernels' accumulations use explicit fma
# intrinsics.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared")


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


def build(source: Path, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of `source`, compiled unless a cached build for this source/CPU/jaxlib
    (and `extra_flags`, e.g. a test's build without some instruction set) exists."""
    from jaxllm.model_executor.model_loader.default_model import cache_dir as jaxllm_cache

    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    # The kernels' shared headers sit beside this file: on the include path and in the key.
    headers = [h.read_text() for h in sorted(_HEADERS.glob("*.h"))]
    key = hashlib.sha256("\0".join([
        source.read_text(), *headers, " ".join(FLAGS + extra_flags), cxx, version,
        importlib.metadata.version("jaxlib"), _cpu_identity(),
    ]).encode()).hexdigest()[:16]
    out_dir = (cache_dir or jaxllm_cache() / "kernels")
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    # Compiled to a temporary name and renamed: processes building at once never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, *extra_flags, "-I", include, "-I", str(_HEADERS), str(source),
               "-o", tmp]
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


def register(source: Path, targets: dict[str, str], fallback: str) -> bool:
    """Builds and loads `source` and registers its handler symbols with XLA's CPU backend as the
    FFI targets named (target name -> symbol). False where disabled, or with a warning naming
    `fallback` (what runs instead) where it cannot be built."""
    if not enabled():
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
    except (KernelBuildError, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernel %s unavailable (%s): %s", source.name, e, fallback)
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True
