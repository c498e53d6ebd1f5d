"""An object built and called in a child process with an environment of its own, for what a
process decides once at start-up: the CPU kernels' build ($JAXLLM_CPU_ISA) and XLA's flags
($XLA_FLAGS). A benchmark can then time, say, the AVX2 build beside the native one in one run,
the settings taking turns, so a shared machine's drift lands on both.

    child = Child(SomeClass, arg, env=isa_env("avx2"))
    result = child.method(*args)  # SomeClass(arg).method(*args), in the child
    child.close()

The class and the arguments are pickled (a class defined in a script is found again by the
child's import of that script, as multiprocessing's spawn does).
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from typing import Any

# What a process reads at start-up to run as on a CPU of that instruction set: our C++ kernels'
# build, XLA's own code generation (`xla_cpu_max_isa`), and OpenBLAS's kernels (numpy's GEMM).
# Not XLA's dots: they run YNNPACK, which picks its kernels from the CPU itself (on one core of
# an AVX-512 machine, capped at AVX2, a float32 GEMM ran at twice the AVX2 FMA peak).
ISA_ENV = {
    "native": {"JAXLLM_CPU_ISA": "native"},
    "avx2": {"JAXLLM_CPU_ISA": "avx2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
}


def isa_env(isa: str) -> dict[str, str]:
    """The environment a child needs to run as on an `isa` machine (ISA_ENV): the parent's, with
    the ISA's variables set and its XLA flags appended to any the parent has."""
    if isa not in ISA_ENV:
        raise ValueError(f"instruction set {isa!r}: expected one of {', '.join(ISA_ENV)}")
    env = dict(ISA_ENV[isa])
    if "XLA_FLAGS" in env and os.environ.get("XLA_FLAGS"):
        env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {env['XLA_FLAGS']}"
    return env


def _serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    try:
        obj = factory(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while (msg := conn.recv()) is not None:
        method, call_args = msg
        try:
            conn.send(("ok", getattr(obj, method)(*call_args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class Child:
    """`factory(*args)` in a new process whose environment is this one's updated with `env`;
    `call` runs one of its methods there and returns the result."""

    def __init__(self, factory: Callable[..., Any], *args: Any, env: dict[str, str]):
        ctx = multiprocessing.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        # A spawned process inherits os.environ as it is at start: set, start, restore.
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            self._proc = ctx.Process(target=_serve, args=(theirs, factory, args), daemon=True)
            self._proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        theirs.close()
        self._receive(f"building {getattr(factory, '__name__', factory)}")

    def _receive(self, what: str) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"child process died {what} (exit code "
                               f"{self._proc.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"child process failed {what}:\n{value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._receive(f"in {method}")

    def __getattr__(self, method: str) -> Callable[..., Any]:
        """`child.method(*args)` for `child.call("method", *args)`: the child stands in for the
        object where the caller would hold it itself."""
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args: self.call(method, *args)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()
        self._conn.close()
