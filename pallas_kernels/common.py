"""What the kernel modules share: backend names, power-of-two sizes, a whole-array BlockSpec."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl

BACKENDS: tuple[str, ...] = ("pallas", "interpret", "reference")


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def default_backend() -> str:
    """"pallas" on a GPU, else "reference" (interpret mode is for tests, far slower than XLA)."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two: the smallest one >= n, for n >= 1."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """Largest power of two <= n, for n >= 1; 1 for n = 0."""
    return 1 << max(0, int(n).bit_length() - 1)


def whole_block_spec(shape: Sequence[int]) -> pl.BlockSpec:
    """A BlockSpec whose block is the whole array, the same for every program of any grid.

    The kernels address such refs themselves (gathered indices, masked loads), because Triton
    only takes power-of-two blocks and the arrays (hidden 896, 14 heads, ...) often are not.
    """
    zeros = (0,) * len(shape)
    return pl.BlockSpec(tuple(shape), lambda *grid_indices: zeros)
