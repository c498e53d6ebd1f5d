"""The MoE block's expert computation on CPU (layers/fused_moe.py): one layer of random experts
and random routing, each way of computing it at each token count, against the needed work (one
dense GEMM of tokens x k rows through one expert's weights: the FLOPs, not the weight reads)
and the dense-over-experts bound (every token through every expert). `jax.lax.ragged_dot`, the
grouped matmul JAX offers, is timed beside them (its gate_up half only).

    PYTHONPATH=. .venv/bin/python benchmarks/moe_experts.py [--experts 64 --top-k 8
        --hidden 1024 --inter 512] [T ...]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers.fused_moe import expert_method, fused_experts, route
from jaxllm.worker.matmul_timing import best_seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens", type=int, nargs="*", default=[1, 4, 16, 64, 256])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.inter
    rng = np.random.default_rng(0)
    w_gu = jnp.asarray(rng.standard_normal((e, 2 * i, h), np.float32) * 0.02)
    w_down = jnp.asarray(rng.standard_normal((e, h, i), np.float32) * 0.02)
    print(f"E={e} top-{k} hidden={h} inter={i}, float32; best of {args.reps}, ms")
    print(f"{'T':>5} {'auto':>8} {'gather':>9} {'grouped':>9} {'floor':>8} {'dense-all':>10} "
          f"{'ragged_dot':>10}")
    for t in args.tokens:
        row = time_one(t, k, w_gu, w_down, rng, args.reps)
        print(f"{t:>5} {expert_method(t, k, e):>8} {row['gather'] * 1e3:>9.2f} "
              f"{row['grouped'] * 1e3:>9.2f} {row['floor'] * 1e3:>8.2f} "
              f"{row['dense'] * 1e3:>10.2f} {row['ragged'] * 1e3:>10.2f}")


def time_one(t: int, k: int, w_gu: jax.Array, w_down: jax.Array, rng: np.random.Generator,
             reps: int) -> dict[str, float]:
    """Seconds of each way at `t` tokens: "gather", "grouped" (fused_experts), "floor" (t x k
    rows through one expert's weights: the FLOPs needed, none of the weight reads), "dense"
    (every token through every expert), "ragged" (jax.lax.ragged_dot of the gate_up half)."""
    e, _, h = w_gu.shape
    i = w_down.shape[2]
    x = jnp.asarray(rng.standard_normal((t, h), np.float32))
    weights, ids = route(jnp.asarray(rng.standard_normal((t, e), np.float32)), k, True)
    row = {}
    for method in ("gather", "grouped"):
        f = jax.jit(functools.partial(fused_experts, method=method))
        row[method] = best_seconds(
            lambda f=f: f(x, w_gu, w_down, weights, ids).block_until_ready(), reps)
    xs = jnp.asarray(rng.standard_normal((t * k, h), np.float32))
    floor = jax.jit(lambda xs: jax.nn.silu(xs @ w_gu[0].T)[:, :i] @ w_down[0].T)
    row["floor"] = best_seconds(lambda: floor(xs).block_until_ready(), reps)
    dense = jax.jit(lambda x: jnp.einsum("eti,ehi->th", jax.nn.silu(
        jnp.einsum("th,eih->eti", x, w_gu))[..., :i], w_down))
    row["dense"] = best_seconds(lambda: dense(x).block_until_ready(), reps)
    gs = jnp.full((e,), t * k // e, jnp.int32).at[0].add(t * k % e)
    w_gu_t = jnp.swapaxes(w_gu, 1, 2)  # ragged_dot wants [G, in, out]
    ragged = jax.jit(lambda xs: jax.lax.ragged_dot(xs, w_gu_t, gs))
    row["ragged"] = best_seconds(lambda: ragged(xs).block_until_ready(), reps)
    return row

if __name__ == "__main__":
    main()
