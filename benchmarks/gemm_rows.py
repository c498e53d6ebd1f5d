"""XLA's rate on the 0.5B model's own matmuls as a function of rows (tokens per step): 24
decoder layers of random weights with the real shapes, kept [out, in] as the engine keeps them,
nothing but the four GEMMs per layer (qkv, o, gate_up, down) and the SiLU between. It is the
ceiling of any XLA-based engine on this machine, and explains the roofline gaps in
docs/perf/cpu-step.md. `--torch` times the same layers through PyTorch (MKL), what HF
transformers runs.

    .venv/bin/python benchmarks/gemm_rows.py [--torch] [rows ...]
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.worker.matmul_timing import best_seconds, decoder_matmuls
from pallas_kernels.checks.lowering_cases import matmul_shape
from pallas_kernels.checks.shapes import QWEN2_SHAPES

MODEL = QWEN2_SHAPES["qwen2.5-0.5b"]
LAYERS, HIDDEN, INTER = MODEL.num_layers, MODEL.hidden_size, MODEL.intermediate_size
QKV = matmul_shape(MODEL, "qkv")[0]

# The sizes `decoder_matmuls` reads, in place of a full ModelConfig.
CONFIG = SimpleNamespace(num_hidden_layers=LAYERS, num_attention_heads=MODEL.num_heads,
                         head_dim=MODEL.head_dim, intermediate_size=INTER)


def model_params(layers: list[dict[str, jax.Array]]) -> dict:
    """The flat per-layer weights in the model's param naming."""
    return {f"layers_{i}": {"self_attn": {"qkv_proj": {"weight": p["qkv"]},
                                          "o_proj": {"weight": p["o"]}},
                            "mlp": {"gate_up_proj": {"weight": p["gate_up"]},
                                    "down_proj": {"weight": p["down"]}}}
            for i, p in enumerate(layers)}


def torch_seconds(layers: list[dict[str, jax.Array]], rows: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)  # as the HF runner of `jaxllm bench`
    weights = [{k: torch.from_numpy(np.array(w)) for k, w in p.items()} for p in layers]
    x0 = torch.randn(rows, HIDDEN) * 0.02

    @torch.inference_mode()
    def forward(x):
        for p in weights:
            x = x + F.linear(F.linear(x, p["qkv"])[:, :HIDDEN], p["o"])
            gate, up = F.linear(x, p["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, p["down"])
        return x

    return best_seconds(lambda: forward(x0), 3)


def main(rows: list[int], with_torch: bool) -> None:
    rng = np.random.default_rng(0)

    def mk(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

    layers = [dict(qkv=mk(QKV, HIDDEN), o=mk(HIDDEN, HIDDEN), gate_up=mk(2 * INTER, HIDDEN),
                   down=mk(HIDDEN, INTER)) for _ in range(LAYERS)]
    params = sum(int(w.size) for p in layers for w in p.values())
    tree = model_params(layers)
    step = jax.jit(lambda p, x: decoder_matmuls(p, CONFIG, x))
    for m in rows:
        x = mk(m, HIDDEN)
        best = best_seconds(lambda _x=x: step(tree, _x).block_until_ready(), 3)
        line = (f"rows {m:4d}: XLA {best * 1e3:8.1f} ms {2 * m * params / best / 1e9:6.1f} "
                f"GFLOP/s {params * 4 / best / 1e9:5.1f} GB/s of weights")
        if with_torch:
            t = torch_seconds(layers, m)
            line += f" | torch {t * 1e3:8.1f} ms {2 * m * params / t / 1e9:6.1f} GFLOP/s"
        print(line, flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([int(a) for a in args if a != "--torch"] or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
         "--torch" in args)
