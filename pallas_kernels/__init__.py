"""Pallas kernels for jaxllm (JAX only: never imports jaxllm or scheduler).

Every op takes `backend=`: "pallas" (Triton, GPU), "interpret" (same kernel on CPU),
"reference" (plain XLA ops).
"""

from __future__ import annotations

import jax

from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope, rope_cos_sin_cache

# TODO remove guard: paged_attention and kv_write are being written in parallel; until they land
# the package must still import so the model can use rms_norm/rope.
try:
    from pallas_kernels.paged_attention import paged_attention
except ImportError:  # pragma: no cover
    paged_attention = None  # type: ignore[assignment]
try:
    from pallas_kernels.kv_write import write_kv
except ImportError:  # pragma: no cover
    write_kv = None  # type: ignore[assignment]

BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")


def default_backend() -> str:
    """"pallas" on a GPU, else "reference" (interpret mode is for tests, far slower than XLA)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


__all__ = [
    "BACKENDS",
    "default_backend",
    "paged_attention",
    "rms_norm",
    "rope",
    "rope_cos_sin_cache",
    "write_kv",
]
