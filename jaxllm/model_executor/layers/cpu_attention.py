"""Paged attention on CPU with our C++ kernel (cpu_attention.cc, an XLA FFI custom call built
and registered by cpu_ffi.py) in place of the XLA reference's token pass.

The reference (pallas_kernels/reference_attention.py) attends sequences with few queries in a
step (decode, verify) token by token and longer ones (prefill chunks) in query tiles that share
each key tile. On the CPU backend with a float32 cache the model hands it this kernel for the
token pass; the reference keeps deciding which sequences take which pass, so a token gets the
same arithmetic whatever step it is in (results do not depend on the batch), and keeps the
query tiles. Same inputs and outputs as `pallas_kernels.paged_attention.paged_attention`; the
same attention up to float32 rounding (tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers import cpu_ffi
from pallas_kernels.reference_attention import paged_attention_reference

SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "jaxllm_paged_attention"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (decided once per process)."""
    return cpu_ffi.register(SOURCE, {_TARGET: "JaxllmPagedAttention"},
                            "attention runs XLA's reference ops (slower at decode)")


def use_for(q: Any, kv_cache: Any, backend: str, tp_axis: str | None = None) -> bool:
    """Whether a step's attention uses this kernel: XLA's CPU backend with the reference kernel
    backend, a float32 cache, head_dim a multiple of 16 up to 256, one device (under tensor
    parallelism the model's attention runs per shard inside shard_map, where the reference's
    plain XLA ops are the tested path)."""
    return (backend == "reference" and tp_axis is None and jax.default_backend() == "cpu"
            and jnp.dtype(kv_cache.dtype) == jnp.float32 and q.shape[-1] % 16 == 0
            and q.shape[-1] <= 256 and available())


def token_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                    max_seq_queries: int) -> jax.Array:
    """The kernel alone: the tokens of sequences with at most `max_seq_queries` queries this
    step, each against its own keys (`paged_attention`'s layout and semantics), float32 [T, H,
    D]; every other row zero, and so are tokens whose position lies past the block table's
    width (the engine's tables always cover their sequences). Needs `available()`."""
    if q.ndim != 3 or kv_cache.ndim != 6 or q.shape[-1] != kv_cache.shape[-1] \
            or q.shape[1] % kv_cache.shape[2] or q.shape[-1] % 16 or q.shape[-1] > 256:
        raise ValueError(f"cpu paged_attention: q [T, H, D] and kv_cache [L, 2, KVH, NB, BS, "
                         f"D] with D a multiple of 16 up to 256 and H of KVH; got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if not 0 <= int(layer) < kv_cache.shape[0]:
        raise ValueError(f"cpu paged_attention: layer {layer} out of range [0, "
                         f"{kv_cache.shape[0]})")
    if not available():
        raise RuntimeError("the CPU paged attention kernel is not available (see the warning)")
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), kv_cache, block_tables.astype(jnp.int32),
                seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
                layer=np.int64(layer), scale=np.float32(scale),
                max_seq_queries=np.int64(max_seq_queries))


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                    max_query_len: int | None = None) -> jax.Array:
    """`pallas_kernels.paged_attention.paged_attention` (backend "reference") with the kernel
    as its token pass: [T, H, D] in q's dtype, padding rows zero."""
    def token_pass(max_seq_queries: int) -> jax.Array:
        return token_attention(q, kv_cache, layer, block_tables, seq_lens, query_start_loc,
                               scale=scale, max_seq_queries=max_seq_queries)

    return paged_attention_reference(q, kv_cache, layer, block_tables, seq_lens,
                                     query_start_loc, scale=scale, max_query_len=max_query_len,
                                     token_pass=token_pass)
