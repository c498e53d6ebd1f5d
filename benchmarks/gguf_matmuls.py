"""quantization="gguf": one step's weight matmuls (24 layers + LM head on every row) on the
embedded model, float32 weights (XLA's dots) against the GGUF blocks kept quantized (our CPU
kernel; int8 panels, gguf_compact's 5-bit ones, and cpu_int8_activations' integer path:
`--trees ...,int8-act`), per row count from a decode step to a
prefill chunk, in one run, with the rate in GFLOP/s (two per weight per row) and as a share of
the machine's float32 GEMM rate (2048^3, the best of XLA and numpy, measured before each row
count; the best so far).

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_matmuls.py [--isa avx2] [ROWS ...]

`--isa avx2` times, beside this process's build, one set up as on an AVX2 machine in a child
process (jaxllm.benchmarks.child.ISA_ENV: our kernel's AVX2 build, XLA's code generation capped
at AVX2, OpenBLAS's Haswell kernels), the processes taking turns per row count. Its GEMM rate is
numpy's there: XLA's dots run YNNPACK, which picks its kernels from the CPU whatever
`xla_cpu_max_isa` says (on one core of an AVX-512 machine it ran above the AVX2 FMA peak).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxllm.benchmarks.child import Child, isa_env
from jaxllm.model_executor.layers import cpu_ffi
from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.worker.machine_rates import measure_gemm
from jaxllm.worker.matmul_timing import best_seconds, weight_matmuls


def weights(tree: dict) -> int:
    """Weights a row multiplies: the decoder's matrices and the LM head."""
    def count(x) -> int:
        if isinstance(x, GGUFWeight):
            rows, cols = x.shape
            return rows * cols
        return x.size if x.ndim == 2 else 0

    body = sum(count(x) for k, v in tree.items() if k.startswith("layers_")
               for x in jax.tree.leaves(v, is_leaf=lambda x: isinstance(x, GGUFWeight)))
    return body + count(tree.get("lm_head", tree["embed_tokens"]))


def matmul_bytes(tree: dict) -> int:
    """Bytes a step's weight matmuls read (the decoder's weights and the LM head, not the
    embedding's gather): at one row, divided by the time, the rate the matmuls stream at."""
    body = sum(x.nbytes for k, v in tree.items() if k.startswith("layers_")
               for x in jax.tree.leaves(v))
    return body + sum(x.nbytes for x in jax.tree.leaves(tree.get("lm_head",
                                                                  tree["embed_tokens"])))


class Matmuls:
    """The model's weights in each format, in this process's build."""

    def __init__(self, trees: list[str]):
        path = default_model_path()
        quantized = load_model(path, progress=False, quantization="gguf", gguf_layout="panels")
        self.cfg = quantized.config
        load = {"float32": lambda: load_model(path, progress=False, quantization="none").params,
                "gguf": lambda: quantized.params,
                "compact": lambda: load_model(path, progress=False, quantization="gguf",
                                              gguf_layout="compact").params,
                "int8-act": lambda: load_model(path, progress=False, quantization="gguf",
                                               gguf_layout="int8").params}
        self.trees = {name: load[name]() for name in trees}
        self.flops_per_row = 2 * weights(self.trees.get("gguf", quantized.params))
        # The AVX2 build's reference is numpy's GEMM alone (the module's docstring).
        self.sources = (("numpy",) if cpu_ffi.default_isa() == "avx2" else ("xla", "numpy"))
        self.gemm = {"xla": 0.0, "numpy": 0.0}

    def describe(self) -> str:
        sizes = ", ".join(f"{name} {sum(x.nbytes for x in jax.tree.leaves(t)) / 2**20:.1f} MiB "
                          f"({matmul_bytes(t) / 2**20:.1f} read by a step's matmuls)"
                          for name, t in self.trees.items())
        return (f"CPU kernel {cpu_ffi.default_isa()} build; weights in memory: {sizes}; GEMM "
                f"reference: {' or '.join(self.sources)}")

    def gemm_rates(self) -> str:
        return ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.gemm.items())

    def time(self, rows: int) -> list[str]:
        """Each format's step at `rows` rows: ms, GFLOP/s and % of the GEMM rate (the best
        measured so far, once more now)."""
        g = measure_gemm()
        for k in self.gemm:
            self.gemm[k] = max(self.gemm[k], g[f"{k}_flops_per_s"])
        reference = max(self.gemm[k] for k in self.sources)
        x = jnp.full((rows, self.cfg.hidden_size), 0.01, jnp.float32)
        out = []
        for name, tree in self.trees.items():
            fn = jax.jit(lambda p, x: weight_matmuls(p, self.cfg, x, x.shape[0]))
            s = best_seconds(lambda fn=fn, t=tree, x=x: fn(t, x).block_until_ready(), 5)
            rate = self.flops_per_row * rows / s
            out.append(f"{name} {s * 1e3:8.2f} ms ({rate / 1e9:5.1f} GFLOP/s, "
                       f"{100 * rate / reference:3.0f} %)")
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--isa", action="append", choices=list(cpu_ffi.ISA_FLAGS), default=[],
                    help="a build timed in a child process set up for it, beside this one's "
                         "(repeatable)")
    ap.add_argument("--trees", type=lambda a: a.split(","), default=["float32", "gguf", "compact"],
                    help="weight formats to time, comma-separated: float32,gguf,compact,"
                         "int8-act")
    args = ap.parse_args()
    # This process's build, then each other one in a child of its own (the kernels' build and
    # XLA's flags are chosen once per process).
    runs = {cpu_ffi.default_isa(): Matmuls(args.trees)}
    for isa in args.isa:
        if isa not in runs:
            runs[isa] = Child(Matmuls, args.trees, env=isa_env(isa))
    for isa, run in runs.items():
        print(f"{isa:>6}: {run.describe()}", flush=True)
    for rows in args.rows:
        for isa, run in runs.items():
            print(f"rows {rows:3d} {isa:>6}: {'  '.join(run.time(rows))}", flush=True)
    for isa, run in runs.items():
        print(f"{isa:>6}: best float32 GEMM 2048^3 over the run, GFLOP/s: {run.gemm_rates()}")
        if isinstance(run, Child):
            run.close()


if __name__ == "__main__":
    main()
