"""quantization="gguf": one decode step's weight matmuls (24 layers + LM head) on the embedded
model, float32 weights against the GGUF blocks kept quantized (fused dequant GEMV per row), per
row count, in one run; picks GGUF_GEMV_MAX_ROWS (jaxllm/config.py).

    PYTHONPATH=. .venv/bin/python benchmarks/gguf_matmuls.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.model_executor.model_loader.default_model import default_model_path
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.worker.matmul_timing import best_seconds, weight_matmuls


def main() -> None:
    loaded = load_model(default_model_path(), progress=False, quantization="gguf")
    cfg = loaded.config
    trees = {"float32": loaded.params, "gguf": loaded.gemv_params}
    for name, tree in trees.items():
        body = sum(x.nbytes for k, v in tree.items() if k.startswith("layers_")
                   for x in jax.tree.leaves(v))
        head = sum(x.nbytes for x in jax.tree.leaves(tree.get("lm_head", tree["embed_tokens"])))
        print(f"{name:>8}: decoder weights {body / 2**20:7.1f} MiB, LM head {head / 2**20:6.1f} "
              f"MiB read per row")
    for rows in (1, 2, 4, 8, 16, 32):
        x = jnp.full((rows, cfg.hidden_size), 0.01, jnp.float32)
        line = [f"rows {rows:3d}"]
        for name, tree in trees.items():
            fn = jax.jit(lambda p, x: weight_matmuls(p, cfg, x, x.shape[0]))
            ms = best_seconds(lambda fn=fn, t=tree, x=x: fn(t, x).block_until_ready(), 5) * 1e3
            line.append(f"{name} {ms:7.2f} ms")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
