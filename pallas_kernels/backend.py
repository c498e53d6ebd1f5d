"""Backend names shared by every kernel's public function."""

from __future__ import annotations

import jax

BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def default_backend() -> str:
    """"pallas" on a GPU, else "reference" (interpret mode is for tests, far slower than XLA)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two: the smallest one >= n."""
    return 1 << max(0, (int(n) - 1).bit_length())
