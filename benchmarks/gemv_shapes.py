"""Read rate of XLA's GEMV (one token through one weight matrix) for each weight shape of the
0.5B model, cold (cycling through enough distinct matrices that none stays in cache), next to a
[rows, 1024] matrix of the same bytes. Explains the batch-1 decode gap in docs/perf/cpu-step.md.

    .venv/bin/python benchmarks/gemv_shapes.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers.linear import linear
from pallas_kernels.checks.lowering_cases import matmul_shape
from pallas_kernels.checks.shapes import QWEN2_SHAPES

MODEL = QWEN2_SHAPES["qwen2.5-0.5b"]
# (name, out, in) of every matrix a 0.5B decode step reads, [out, in] as the model keeps them.
SHAPES = [*((f"{layer}_proj", *matmul_shape(MODEL, layer))
            for layer in ("qkv", "o", "gate_up", "down")),
          ("lm_head", MODEL.vocab_size, MODEL.hidden_size),
          ("same bytes as lm_head", MODEL.vocab_size * MODEL.hidden_size // 1024, 1024)]
COLD_BYTES = 400 << 20


def main() -> None:
    gemv = jax.jit(linear)
    rng = np.random.default_rng(0)
    for name, out, inp in SHAPES:
        count = max(1, COLD_BYTES // (out * inp * 4))
        mats = [jnp.asarray(rng.standard_normal((out, inp), dtype=np.float32))
                for _ in range(count)]
        x = jnp.asarray(rng.standard_normal((1, inp), dtype=np.float32))
        gemv(x, mats[0]).block_until_ready()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for w in mats:
                y = gemv(x, w)
            y.block_until_ready()
            best = min(best, (time.perf_counter() - start) / count)
        print(f"{name:>22} [{out:6d}, {inp:4d}] {out * inp * 4 / 2**20:7.1f} MiB  "
              f"{best * 1e3:7.3f} ms  {out * inp * 4 / best / 1e9:5.1f} GB/s")
        del mats


if __name__ == "__main__":
    main()
