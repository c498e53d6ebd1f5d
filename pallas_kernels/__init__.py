"""Pallas kernels for jaxllm (JAX only: never imports jaxllm or scheduler).

Every op takes `backend=`: "pallas" (Triton, GPU), "interpret" (same kernel on CPU),
"reference" (plain XLA ops).
"""

from __future__ import annotations

import jax

from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope, rope_cos_sin_cache

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
