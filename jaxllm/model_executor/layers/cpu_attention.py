"""Paged attention of steps with few queries per sequence on CPU: our C++ kernel
(cpu_attention.cc), an XLA FFI custom call built and registered by cpu_ffi.py.

The model runs it instead of the XLA reference (pallas_kernels/reference_attention.py) on the
CPU backend, with a float32 cache, for steps of at most `MAX_QUERY_LEN` queries per sequence:
decode and speculative-decoding verify steps, and the 16-token bucket (short prompts and
chunks); larger prefill buckets keep the reference's query tiles, whose real matmuls suit many
queries per sequence. Same inputs and outputs as
`pallas_kernels.paged_attention.paged_attention`; the same attention up to float32 rounding
(tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers import cpu_ffi

SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "jaxllm_paged_attention"
# Steps with at most this many queries per sequence: every query reads its own keys, which for
# more queries per sequence the reference's shared key tiles do better.
MAX_QUERY_LEN = 16


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (decided once per process)."""
    return cpu_ffi.register(SOURCE, {_TARGET: "JaxllmPagedAttention"},
                            "attention runs XLA's reference ops (slower at decode)")


def use_for(q: Any, kv_cache: Any, max_query_len: int | None, backend: str,
            tp_axis: str | None = None) -> bool:
    """Whether a step's attention runs this kernel: XLA's CPU backend with the reference kernel
    backend, a float32 cache, head_dim a multiple of 16 and few queries per sequence, one
    device (under tensor parallelism the model's attention runs per shard inside shard_map,
    where the reference's plain XLA ops are the tested path)."""
    return (backend == "reference" and tp_axis is None and max_query_len is not None
            and max_query_len <= MAX_QUERY_LEN and jax.default_backend() == "cpu"
            and jnp.dtype(kv_cache.dtype) == jnp.float32 and q.shape[-1] % 16 == 0
            and q.shape[-1] <= 256
            and available())


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float
                    ) -> jax.Array:
    """`pallas_kernels.paged_attention.paged_attention` (its layout and semantics) on CPU: q
    [T, H, D] float32, kv_cache [L, 2, KVH, NB, BS, D] float32, `layer` a Python int. Returns
    [T, H, D] in q's dtype; padding rows are zeros, and so are tokens whose position lies past
    the block table's width (the engine's tables always cover their sequences). Needs
    `available()`."""
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
    out = call(q.astype(jnp.float32), kv_cache, block_tables.astype(jnp.int32),
               seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
               layer=np.int64(layer), scale=np.float32(scale))
    return out.astype(q.dtype)
