"""Attention on CPU, 24 layers of one step at Qwen2.5-0.5B shapes (14 query / 2 KV heads,
head_dim 64, block 16, float32): XLA's reference (`pallas_kernels/reference_attention.py`)
against our C++ kernel (`jaxllm/model_executor/layers/cpu_attention.cc`), the same jitted chain
of 24 calls each, best of 10 after a warm-up. A case `context:seqs:queries` is `seqs`
sequences of `context` tokens whose last `queries` are this step's (1: decode; the context
itself: a whole prompt's prefill). Blocks are a random permutation of a 2048-block cache, as a
long-running engine's are.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_attention.py [context:seqs[:queries] ...]
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers import cpu_attention
from jaxllm.worker.matmul_timing import best_seconds
from pallas_kernels.paged_attention import paged_attention

LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, WIDTH = 24, 2, 14, 64, 16, 2048, 128


def step(kernel: bool, max_query_len: int) -> Callable[..., jax.Array]:
    @jax.jit
    def run(q, kv, tables, seq_lens, qsl):
        out = q
        for layer in range(LAYERS):
            if kernel:
                out = cpu_attention.paged_attention(out, kv, layer, tables, seq_lens, qsl,
                                                    scale=HEAD_DIM ** -0.5)
            else:
                out = paged_attention(out, kv, layer, tables, seq_lens, qsl,
                                      scale=HEAD_DIM ** -0.5, max_query_len=max_query_len)
        return out
    return run


def main() -> None:
    cases = [tuple(int(v) for v in a.split(":")) for a in sys.argv[1:]] or \
        [(32, 1), (256, 1), (1024, 1), (256, 16), (128, 1, 128), (512, 1, 512), (1024, 1, 1024),
         (1024, 1, 256)]
    rng = np.random.default_rng(0)
    kv = jnp.asarray(rng.standard_normal(
        (LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM), np.float32))
    for context, seqs, *rest in cases:
        queries = rest[0] if rest else 1
        tables = jnp.asarray(rng.permutation(NUM_BLOCKS)[:seqs * WIDTH].reshape(seqs, WIDTH)
                             .astype(np.int32))
        seq_lens = jnp.full((seqs,), context, jnp.int32)
        qsl = jnp.arange(seqs + 1, dtype=jnp.int32) * queries
        q = jnp.asarray(rng.standard_normal((seqs * queries, HEADS, HEAD_DIM), np.float32))
        line = [f"context {context:5d}, {seqs:2d} sequences, {queries:4d} queries each:"]
        args = (q, kv, tables, seq_lens, qsl)
        for name, kernel in (("XLA reference", False), ("C++ kernel", True)):
            fn = step(kernel, queries)
            ms = best_seconds(lambda fn=fn, args=args: fn(*args).block_until_ready(), 10) * 1e3
            line.append(f"{name} {ms:7.2f} ms")
        print("  ".join(line), flush=True)


if __name__ == "__main__":
    main()
