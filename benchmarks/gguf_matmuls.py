"""quantization="gguf": one step's weight matmuls (24 layers + LM head on every row) on the
embedded model, float32 weights (XLA's dots) against the GGUF blocks kept quantized (our CPU
kernel; int8 panels, and gguf_compact's 5-bit ones), per row count from a decode step to a
prefill chunk, in one run, with the rate in GFLOP/s (two per weight per row).

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_matmuls.py [ROWS ...]

`JAXLLM_CPU_ISA=avx2` times our kernel's AVX2 build instead of the native one (on an AVX-512
machine too: docs/kernels.md).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from jaxllm.model_executor.layers.quantization.gguf import GGUFWeight
from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.loader import load_model
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


def main() -> None:
    rows_list = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 32, 64, 128, 512]
    path = default_model_path()
    quantized = load_model(path, progress=False, quantization="gguf")
    cfg = quantized.config
    trees = {"float32": load_model(path, progress=False, quantization="none").params,
             "gguf": quantized.params,
             "compact": load_model(path, progress=False, quantization="gguf",
                                   gguf_compact=True).params}
    for name, tree in trees.items():
        size = sum(x.nbytes for x in jax.tree.leaves(tree))
        print(f"{name:>8}: weights {size / 2**20:7.1f} MiB in memory", flush=True)
    flops_per_row = 2 * weights(trees["float32"])
    for rows in rows_list:
        x = jnp.full((rows, cfg.hidden_size), 0.01, jnp.float32)
        line = [f"rows {rows:3d}"]
        for name, tree in trees.items():
            fn = jax.jit(lambda p, x: weight_matmuls(p, cfg, x, x.shape[0]))
            ms = best_seconds(lambda fn=fn, t=tree, x=x: fn(t, x).block_until_ready(), 5) * 1e3
            line.append(f"{name} {ms:8.2f} ms ({flops_per_row * rows / ms / 1e6:5.1f} GFLOP/s)")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
