"""The kernel backends each kernel test runs: Pallas interpret mode on any machine, and the
native Pallas (Triton) backend when a CUDA GPU is present — skipped, visibly, on CPU."""

import jax
import pytest

HAS_GPU = jax.default_backend() == "gpu"

KERNEL_BACKENDS = [
    "interpret",
    pytest.param("pallas", marks=pytest.mark.skipif(
        not HAS_GPU, reason="no CUDA GPU: the native Pallas backend needs one (CPU proves the "
                            "kernels in interpret mode and by lowering for CUDA)")),
]
