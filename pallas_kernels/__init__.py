"""Pallas kernels for jaxllm (JAX only: never imports jaxllm or scheduler).

Every op takes `backend=`: "pallas" (Triton, GPU), "interpret" (same kernel on CPU),
"reference" (plain XLA ops).
"""

from __future__ import annotations

from pallas_kernels.common import BACKENDS, default_backend
from pallas_kernels.dequant_matmul import dequant_matmul
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope, rope_cos_sin_cache

__all__ = [
    "BACKENDS",
    "default_backend",
    "dequant_matmul",
    "paged_attention",
    "rms_norm",
    "rope",
    "rope_cos_sin_cache",
    "write_kv",
]
