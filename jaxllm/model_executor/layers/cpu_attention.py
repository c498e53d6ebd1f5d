"""Paged attention on CPU with our C++ kernel (cpu_attention.cc, an XLA FFI custom call built
and registered by cpu_ffi.py), in place of the XLA reference
(pallas_kernels/reference_attention.py) for every token of every step on the CPU backend with a
float32 cache. A token gets the same arithmetic whatever step it is in, so results do not
depend on the batch (or on a preempted request being recomputed as a prefill). Same inputs and
outputs as `pallas_kernels.paged_attention.paged_attention`; the same attention up to float32
rounding (tests/kernels/test_cpu_attention.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.model_executor.layers import cpu_ffi
from pallas_kernels.attention_common import check_soft_cap

SOURCE = Path(__file__).with_suffix(".cc")
_TARGET = "jaxllm_paged_attention"


def available(isa: str | None = None) -> bool:
    """Whether the kernel's `isa` build (cpu_ffi.ISA_FLAGS; default the process's,
    $JAXLLM_CPU_ISA) is built and registered (decided once per process and build)."""
    return _available(cpu_ffi.resolve_isa(isa))


@functools.cache
def _available(isa: str) -> bool:
    return cpu_ffi.register(SOURCE, {_TARGET: "JaxllmPagedAttention"},
                            "attention runs XLA's reference ops (slower at decode)", isa)


def takes(head_dim: int) -> bool:
    """Whether the kernel handles this head size (a multiple of 16 up to 256)."""
    return head_dim % 16 == 0 and head_dim <= 256


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *,
                    scale: float, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, isa: str | None = None) -> jax.Array:
    """`pallas_kernels.paged_attention.paged_attention`'s layout and semantics: each token
    against its own sequence's keys (with a `sliding_window` W, the W up to its own; with a
    `logits_soft_cap`, over logits capped as cap * tanh(logit / cap)), [T, H, D]
    in q's dtype (float32 inside); padding rows are zero, and so are tokens whose position lies
    past the block table's width (the engine's tables always cover their sequences). Runs the
    kernel's `isa` build (default the process's); needs `available(isa)`."""
    if q.ndim != 3 or kv_cache.ndim != 6 or q.shape[-1] != kv_cache.shape[-1] \
            or q.shape[1] % kv_cache.shape[2] or q.shape[-1] % 16 or q.shape[-1] > 256:
        raise ValueError(f"cpu paged_attention: q [T, H, D] and kv_cache [L, 2, KVH, NB, BS, "
                         f"D] with D a multiple of 16 up to 256 and H a multiple of KVH; got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if jnp.dtype(kv_cache.dtype) != jnp.float32:
        raise ValueError(f"cpu paged_attention: the kernel reads a float32 cache, got "
                         f"{jnp.dtype(kv_cache.dtype).name}")
    if not 0 <= int(layer) < kv_cache.shape[0]:
        raise ValueError(f"cpu paged_attention: layer {layer} out of range [0, "
                         f"{kv_cache.shape[0]})")
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"cpu paged_attention: sliding_window must be a positive integer or "
                         f"None, got {sliding_window!r}")
    logits_soft_cap = check_soft_cap(logits_soft_cap)
    isa = cpu_ffi.resolve_isa(isa)
    if not available(isa):
        raise RuntimeError(f"the CPU paged attention kernel's {isa} build is not available (see "
                           f"the warning)")
    call = jax.ffi.ffi_call(cpu_ffi.target_name(_TARGET, isa),
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), kv_cache, block_tables.astype(jnp.int32),
               seq_lens.astype(jnp.int32), query_start_loc.astype(jnp.int32),
               layer=np.int64(layer), scale=np.float32(scale),
               window=np.int64(sliding_window or 0),  # 0: the whole context
               soft_cap=np.float32(logits_soft_cap or 0.0))  # 0: no cap
    return out.astype(q.dtype)
