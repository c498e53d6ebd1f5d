"""skinny_matmul (the weight-streaming GEMV): interpret mode against the reference and against
float64 numpy, at decode row counts and Qwen2 widths."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul import MAX_ROWS, launch_config, skinny_matmul
from tests.kernel_backends import KERNEL_BACKENDS


def _inputs(m, n, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = (rng.normal(size=(n, k)) * 0.05).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("m, n, k", [(1, 1152, 896), (3, 896, 896), (8, 9728, 896),
                                     (16, 896, 4864), (5, 37, 100), (2, 3, 1)])
def test_float32_matches_float64(backend, m, n, k):
    x, w = _inputs(m, n, k, jnp.float32)
    got = np.asarray(skinny_matmul(x, w, backend=backend))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    # float32 sums of k products: a few ulps of the sum of |x w|.
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w)).T)
    assert np.all(np.abs(got - want) <= bound + 1e-30)
    ref = np.asarray(skinny_matmul(x, w, backend="reference"))
    assert np.all(np.abs(ref - want) <= bound + 1e-30)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bfloat16_operands_float32_sums(backend):
    x, w = _inputs(4, 1152, 896, jnp.bfloat16)
    got = skinny_matmul(x, w, out_dtype=jnp.float32, backend=backend)
    assert got.dtype == jnp.float32
    want = skinny_matmul(x, w, out_dtype=jnp.float32, backend="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert skinny_matmul(x, w, backend=backend).dtype == jnp.bfloat16
    # Mixed: float32 weights under bfloat16 activations, each read as given.
    w32 = w.astype(jnp.float32)
    np.testing.assert_allclose(
        np.asarray(skinny_matmul(x, w32, out_dtype=jnp.float32, backend=backend)),
        np.asarray(want), rtol=1e-5, atol=1e-5)


def test_launch_config_fills_the_gpu_and_bounds_the_tile():
    for n, k in ((1152, 896), (896, 4864), (151936, 896), (37, 100)):
        cfg = launch_config(1, n, k)
        assert cfg["block_n"] * cfg["block_k"] <= 2048 and cfg["block_k"] <= 512
        programs = -(-n // cfg["block_n"])
        assert programs >= 264 or cfg["block_n"] == 2 or cfg["block_n"] >= n


def test_bad_inputs_are_named():
    x, w = _inputs(2, 8, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        skinny_matmul(x, w[:, :8])
    with pytest.raises(ValueError, match=f"1 to {MAX_ROWS} rows, got 17"):
        skinny_matmul(jnp.zeros((17, 16)), w)
    with pytest.raises(ValueError, match="w must be bfloat16 or float32, got int8"):
        skinny_matmul(x, w.astype(jnp.int8))
