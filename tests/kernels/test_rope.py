"""RoPE: cache and reference vs Hugging Face's formula in numpy; Pallas (interpret) vs reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.rope import rope, rope_cos_sin_cache
from tests.kernel_backends import KERNEL_BACKENDS

MAX_POS = 32768
# float32: the same float32 products on both sides, up to operation order.
F32_TOL = dict(atol=1e-5, rtol=1e-5)
# bfloat16 outputs: each side rounds a float32 result to bfloat16 (relative spacing up to
# 2^-7 for values in [1, 2)), so allow ~2 ulps of a value of a few units.
BF16_TOL = dict(atol=3e-2, rtol=2e-2)

# (num_heads, num_kv_heads) of Qwen2.5 0.5B / 1.5B / 7B plus small and power-of-two cases.
HEADS = st.sampled_from([(14, 2), (12, 2), (28, 4), (1, 1), (8, 8), (3, 1)])
TOKENS = st.sampled_from([1, 2, 7, 16, 100, 256])


def _hf_cos_sin(positions: np.ndarray, head_dim: int, theta: float):
    """Hugging Face Qwen2RotaryEmbedding, written in float64 numpy."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _hf_apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Hugging Face apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _inputs(tokens: int, heads: tuple[int, int], head_dim: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.normal(0.0, 2.0, (tokens, heads[0], head_dim))
    k = rng.normal(0.0, 2.0, (tokens, heads[1], head_dim))
    pos = rng.integers(0, MAX_POS, tokens)
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(pos, jnp.int32)


def _np(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32))


_CACHES: dict = {}


def _cache(head_dim: int, theta: float, dtype=jnp.float32) -> jax.Array:
    key = (head_dim, theta, jnp.dtype(dtype).name)
    if key not in _CACHES:
        _CACHES[key] = rope_cos_sin_cache(head_dim, MAX_POS, theta, dtype)
    return _CACHES[key]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_cache_matches_hf_formula(head_dim: int, theta: float) -> None:
    cache = np.asarray(_cache(head_dim, theta))
    assert cache.shape == (MAX_POS, head_dim) and cache.dtype == np.float32
    positions = np.array([0, 1, 2, 17, 1000, 4095, 32767])
    cos, sin = _hf_cos_sin(positions, head_dim, theta)
    half = head_dim // 2
    # float32 rounding of values in [-1, 1]: half an ulp is 6e-8.
    np.testing.assert_allclose(cache[positions, :half], cos[:, :half], atol=1e-7, rtol=0)
    np.testing.assert_allclose(cache[positions, half:], sin[:, :half], atol=1e-7, rtol=0)


@settings(max_examples=15, deadline=None)
@given(tokens=TOKENS, heads=HEADS, head_dim=st.sampled_from([64, 128]),
       theta=st.sampled_from([10000.0, 1000000.0]), seed=st.integers(0, 2**16))
def test_reference_matches_hf(tokens: int, heads: tuple[int, int], head_dim: int, theta: float,
                              seed: int) -> None:
    q, k, pos = _inputs(tokens, heads, head_dim, jnp.float32, seed)
    q_out, k_out = rope(q, k, pos, _cache(head_dim, theta), backend="reference")
    cos, sin = _hf_cos_sin(np.asarray(pos), head_dim, theta)
    np.testing.assert_allclose(_np(q_out), _hf_apply(np.asarray(q, np.float64), cos, sin),
                               **F32_TOL)
    np.testing.assert_allclose(_np(k_out), _hf_apply(np.asarray(k, np.float64), cos, sin),
                               **F32_TOL)
    assert q_out.dtype == q.dtype and q_out.shape == q.shape
    assert k_out.dtype == k.dtype and k_out.shape == k.shape


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=15, deadline=None)
@given(tokens=TOKENS, heads=HEADS, head_dim=st.sampled_from([64, 128]),
       theta=st.sampled_from([10000.0, 1000000.0]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(backend: str, tokens: int, heads: tuple[int, int],
                                  head_dim: int, theta: float, dtype, seed: int) -> None:
    q, k, pos = _inputs(tokens, heads, head_dim, dtype, seed)
    cache = _cache(head_dim, theta, dtype)
    got = rope(q, k, pos, cache, backend=backend)
    want = rope(q, k, pos, cache, backend="reference")
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape
        np.testing.assert_allclose(_np(g), _np(w), **tol)


def test_single_token_and_position_zero_is_identity() -> None:
    q, k, _ = _inputs(1, (14, 2), 64, jnp.float32, 3)
    pos = jnp.zeros((1,), jnp.int32)
    for backend in ("reference", "interpret"):
        q_out, k_out = rope(q, k, pos, _cache(64, 1e6), backend=backend)
        np.testing.assert_allclose(_np(q_out), _np(q), atol=1e-7)
        np.testing.assert_allclose(_np(k_out), _np(k), atol=1e-7)


def test_under_jit() -> None:
    q, k, pos = _inputs(7, (14, 2), 64, jnp.float32, 4)
    cache = _cache(64, 1e6)
    f = jax.jit(lambda q, k, p, c: rope(q, k, p, c, backend="interpret"))
    for g, w in zip(f(q, k, pos, cache), rope(q, k, pos, cache), strict=True):
        np.testing.assert_allclose(_np(g), _np(w), **F32_TOL)


def test_bad_backend_raises() -> None:
    q, k, pos = _inputs(2, (2, 1), 64, jnp.float32, 0)
    with pytest.raises(ValueError, match="'triton'"):
        rope(q, k, pos, _cache(64, 1e4), backend="triton")


def test_partial_last_row_block() -> None:
    # Few heads make a program hold several tokens; T = 1100 is not a multiple of them, so the
    # last program's out-of-range rows must be masked on load and store.
    q, k, pos = _inputs(1100, (3, 1), 64, jnp.float32, 5)
    cache = _cache(64, 1e4)
    got = rope(q, k, pos, cache, backend="interpret")
    for g, w in zip(got, rope(q, k, pos, cache), strict=True):
        np.testing.assert_allclose(_np(g), _np(w), **F32_TOL)
