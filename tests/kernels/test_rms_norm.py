"""RMSNorm: reference vs a float64 numpy formula, and the Pallas kernel (interpret) vs reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from tests.kernel_backends import KERNEL_BACKENDS

EPS = 1e-6
# float32: both sides compute in float32 and differ only in summation order.
F32_TOL = dict(atol=1e-5, rtol=1e-5)
# bfloat16 output: each side rounds a float32 result to bfloat16 (8 significant bits, relative
# spacing up to 2^-7), so a summation-order difference can flip the last bit: allow ~2 ulps.
BF16_TOL = dict(atol=2e-2, rtol=2e-2)

TOKENS = st.sampled_from([1, 2, 7, 16, 33, 100, 256])
HIDDEN = st.sampled_from([64, 100, 128, 896, 1536])


def _inputs(tokens: int, hidden: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    # Non-zero-mean, varied-scale rows, so the norm is not trivially ~1.
    x = rng.normal(0.5, 3.0, (tokens, hidden)) * rng.uniform(0.1, 10.0, (tokens, 1))
    r = rng.normal(0.0, 2.0, (tokens, hidden))
    w = rng.normal(1.0, 0.5, (hidden,))
    return (jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(r, dtype))


def _numpy_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _np(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32))


@settings(max_examples=15, deadline=None)
@given(tokens=TOKENS, hidden=HIDDEN, residual=st.booleans(), seed=st.integers(0, 2**16))
def test_reference_matches_numpy(tokens: int, hidden: int, residual: bool, seed: int) -> None:
    x, w, r = _inputs(tokens, hidden, jnp.float32, seed)
    if residual:
        y, h = rms_norm(x, w, EPS, r, backend="reference")
        h_expected = np.asarray(x, np.float64) + np.asarray(r, np.float64)
        np.testing.assert_allclose(_np(h), h_expected, **F32_TOL)
        np.testing.assert_allclose(_np(y), _numpy_rms_norm(h_expected, np.asarray(w), EPS),
                                   **F32_TOL)
    else:
        y = rms_norm(x, w, EPS, backend="reference")
        np.testing.assert_allclose(_np(y), _numpy_rms_norm(np.asarray(x), np.asarray(w), EPS),
                                   **F32_TOL)
    assert y.dtype == x.dtype and y.shape == x.shape


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=15, deadline=None)
@given(tokens=TOKENS, hidden=HIDDEN, residual=st.booleans(),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(backend: str, tokens: int, hidden: int, residual: bool, dtype,
                                  seed: int) -> None:
    x, w, r = _inputs(tokens, hidden, dtype, seed)
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    res = r if residual else None
    got = rms_norm(x, w, EPS, res, backend=backend)
    want = rms_norm(x, w, EPS, res, backend="reference")
    if residual:
        (y, h), (y_ref, h_ref) = got, want
        # The residual sum is one float32 add rounded once to dtype on both sides: exact.
        np.testing.assert_array_equal(_np(h), _np(h_ref))
        assert h.dtype == dtype
    else:
        y, y_ref = got, want
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(_np(y), _np(y_ref), **tol)


@pytest.mark.parametrize("hidden", [896, 1536])
def test_single_token(hidden: int) -> None:
    x, w, r = _inputs(1, hidden, jnp.float32, 0)
    np.testing.assert_allclose(_np(rms_norm(x, w, EPS, backend="interpret")),
                               _numpy_rms_norm(np.asarray(x), np.asarray(w), EPS), **F32_TOL)
    y, h = rms_norm(x, w, EPS, r, backend="interpret")
    y_ref, h_ref = rms_norm_reference(x, w, EPS, r)
    np.testing.assert_allclose(_np(y), _np(y_ref), **F32_TOL)
    np.testing.assert_array_equal(_np(h), _np(h_ref))


def test_zero_rows_stay_finite() -> None:
    # A padded (all-zero) token row must give zeros, not NaN: eps keeps rsqrt finite.
    x = jnp.zeros((3, 896), jnp.float32)
    w = jnp.ones((896,), jnp.float32)
    for backend in ("reference", "interpret"):
        np.testing.assert_array_equal(np.asarray(rms_norm(x, w, EPS, backend=backend)), 0.0)


def test_under_jit() -> None:
    x, w, r = _inputs(7, 896, jnp.float32, 1)
    f = jax.jit(lambda x, w, r: rms_norm(x, w, EPS, r, backend="interpret"))
    y, h = f(x, w, r)
    y_ref, h_ref = rms_norm_reference(x, w, EPS, r)
    np.testing.assert_allclose(_np(y), _np(y_ref), **F32_TOL)


def test_bad_backend_raises() -> None:
    x, w, _ = _inputs(2, 64, jnp.float32, 0)
    with pytest.raises(ValueError, match="'cuda'"):
        rms_norm(x, w, EPS, backend="cuda")


def test_bad_shapes_raise() -> None:
    x, w, _ = _inputs(2, 64, jnp.float32, 0)
    with pytest.raises(ValueError):
        rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError):
        rms_norm(x, w, EPS, x[:1])


@pytest.mark.parametrize(("tokens", "hidden"), [(385, 896), (300, 100)])
def test_partial_last_row_block(tokens: int, hidden: int) -> None:
    # Large enough that a program holds several rows, with T not a multiple of them: the last
    # program's out-of-range rows must be masked on load and store.
    x, w, r = _inputs(tokens, hidden, jnp.float32, 2)
    y, h = rms_norm(x, w, EPS, r, backend="interpret")
    y_ref, h_ref = rms_norm_reference(x, w, EPS, r)
    np.testing.assert_allclose(_np(y), _np(y_ref), **F32_TOL)
    np.testing.assert_array_equal(_np(h), _np(h_ref))


def test_leading_dims_are_kept() -> None:
    x, w, r = _inputs(6, 64, jnp.float32, 3)
    x3, r3 = x.reshape(2, 3, 64), r.reshape(2, 3, 64)
    for backend in ("reference", "interpret"):
        y, h = rms_norm(x3, w, EPS, r3, backend=backend)
        assert y.shape == h.shape == (2, 3, 64)
        np.testing.assert_allclose(_np(y).reshape(6, 64),
                                   _np(rms_norm_reference(x, w, EPS, r)[0]), **F32_TOL)
