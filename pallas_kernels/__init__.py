"""Pallas kernels for jaxllm (JAX only: never imports jaxllm or scheduler).

A module per op, each with one public function that takes `backend=`: "pallas" (Triton, GPU),
"interpret" (same kernel on CPU), "reference" (plain XLA ops): `rms_norm.rms_norm`,
`rope.rope` (and `rope.rope_cos_sin_cache`), `kv_write.write_kv`,
`paged_attention.paged_attention` (split-K decode in split_k_decode.py, the XLA version in
reference_attention.py, what both kernels share in attention_common.py) and
`dequant_matmul.dequant_matmul`. `checks/` lowers and compiles them for CUDA without a GPU and
models their H100 time.
"""

from __future__ import annotations

from pallas_kernels.common import BACKENDS

__all__ = ["BACKENDS"]
