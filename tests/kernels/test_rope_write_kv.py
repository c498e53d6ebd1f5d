"""rope_write_kv (bias, RoPE and the KV write in one kernel): the reference equals the three ops
it replaces, interpret mode equals the reference, the cache is updated in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.common import lower_for_cuda
from pallas_kernels.kv_write import write_kv
from pallas_kernels.rope import rope, rope_cos_sin_cache
from pallas_kernels.rope_write_kv import rope_write_kv
from tests.kernel_backends import KERNEL_BACKENDS

MAX_POS = 4096
_CACHE = rope_cos_sin_cache(64, MAX_POS, 1e6)
_jitted = jax.jit(rope_write_kv, static_argnums=(5,),
                  static_argnames=("num_heads", "num_kv_heads", "backend"))


def _inputs(tokens, heads, kv_heads, *, head_dim=64, layers=3, blocks=12, block_size=16,
            padding=2, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = jnp.asarray(rng.normal(0, 2, (tokens, width)), dtype)
    bias = jnp.asarray(rng.normal(0, 0.5, (width,)), dtype)
    pos = jnp.asarray(rng.integers(0, MAX_POS, tokens), jnp.int32)
    kv = jnp.asarray(rng.normal(size=(layers, 2, kv_heads, blocks, block_size, head_dim)),
                     dtype)
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    slots[rng.permutation(tokens)[:min(padding, tokens)]] = -1
    return qkv, bias, pos, kv, jnp.asarray(slots)


def _three_ops(qkv, bias, pos, kv, layer, slots, heads, kv_heads):
    """What the fused op replaces: the bias add, RoPE, the KV write (reference backend)."""
    head_dim = kv.shape[-1]
    x = qkv + bias
    q, k, v = jnp.split(x, [heads * head_dim, (heads + kv_heads) * head_dim], axis=-1)
    t = qkv.shape[0]
    q, k = rope(q.reshape(t, heads, head_dim), k.reshape(t, kv_heads, head_dim), pos, _CACHE)
    return q, write_kv(kv, layer, k, v.reshape(t, kv_heads, head_dim), slots)


@pytest.mark.parametrize("heads, kv_heads", [(14, 2), (12, 2), (28, 4), (3, 1)])
def test_reference_is_bias_rope_and_write(heads, kv_heads):
    qkv, bias, pos, kv, slots = _inputs(21, heads, kv_heads)
    q, out = _jitted(qkv, bias, pos, _CACHE, kv, 1, slots, num_heads=heads,
                     num_kv_heads=kv_heads, backend="reference")
    want_q, want_kv = _three_ops(qkv, bias, pos, kv, 1, slots, heads, kv_heads)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_kv))


@settings(max_examples=6, deadline=None)
@given(tokens=st.sampled_from([1, 2, 7, 16, 33]),
       heads=st.sampled_from([(14, 2), (12, 2), (28, 4), (1, 1), (3, 1)]),
       with_bias=st.booleans(), layer=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_interpret_equals_reference(tokens, heads, with_bias, layer, seed):
    qkv, bias, pos, kv, slots = _inputs(tokens, *heads, seed=seed)
    b = bias if with_bias else None
    args = (qkv, b, pos, _CACHE, kv, layer, slots)
    kw = dict(num_heads=heads[0], num_kv_heads=heads[1])
    q_ref, kv_ref = _jitted(*args, **kw, backend="reference")
    q_int, kv_int = _jitted(*args, **kw, backend="interpret")
    # The same float32 products and sums in the same order: equal to rounding at most.
    np.testing.assert_allclose(np.asarray(q_int), np.asarray(q_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kv_int), np.asarray(kv_ref), atol=1e-5, rtol=1e-5)
    # Only the real tokens' slots of `layer` changed; other layers are bit-identical.
    others = [i for i in range(kv.shape[0]) if i != layer]
    np.testing.assert_array_equal(np.asarray(kv_int)[others], np.asarray(kv)[others])
    changed = np.any(np.asarray(kv_int)[layer] != np.asarray(kv)[layer], axis=(0, 1, 4))
    assert changed.sum() == int((np.asarray(slots) >= 0).sum())


@pytest.mark.parametrize("tokens", [257, 300])
def test_multi_row_tiles_with_a_partial_last_tile(tokens):
    # From 256 tokens a program takes several rows; the last tile is partly past the end.
    qkv, bias, pos, kv, slots = _inputs(tokens, 14, 2, blocks=40, padding=9, seed=tokens)
    args = (qkv, bias, pos, _CACHE, kv, 0, slots)
    kw = dict(num_heads=14, num_kv_heads=2)
    q_ref, kv_ref = _jitted(*args, **kw, backend="reference")
    q_int, kv_int = _jitted(*args, **kw, backend="interpret")
    np.testing.assert_allclose(np.asarray(q_int), np.asarray(q_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kv_int), np.asarray(kv_ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_bf16_within_rounding_of_float32(backend):
    qkv, bias, pos, kv, slots = _inputs(9, 14, 2)
    kw = dict(num_heads=14, num_kv_heads=2, backend=backend)
    q32, kv32 = _jitted(qkv, bias, pos, _CACHE, kv, 2, slots, **kw)
    lo = [x.astype(jnp.bfloat16) for x in (qkv, bias, kv)]
    q16, kv16 = _jitted(lo[0], lo[1], pos, _CACHE, lo[2], 2, slots, **kw)
    assert q16.dtype == kv16.dtype == jnp.bfloat16
    # Inputs rounded to bfloat16 (values of a few units): a few bfloat16 ulps.
    np.testing.assert_allclose(np.asarray(q16.astype(jnp.float32)), np.asarray(q32),
                               atol=0.1, rtol=0.03)
    np.testing.assert_allclose(np.asarray(kv16.astype(jnp.float32)), np.asarray(kv32),
                               atol=0.1, rtol=0.03)


def test_cache_updated_in_place_when_donated():
    # The kernel aliases the cache operand to its output: lowered for CUDA, the donated cache
    # is the output buffer (no copy of a cache-sized array).
    qkv, bias, pos, kv, slots = _inputs(4, 14, 2)

    def step(kv, qkv, bias, pos, slots):
        return rope_write_kv(qkv, bias, pos, _CACHE, kv, 1, slots, num_heads=14,
                             num_kv_heads=2, backend="pallas")

    lowered = lower_for_cuda(step, (kv, qkv, bias, pos, slots), donate_argnums=0)
    text = lowered.as_text()
    assert "tf.aliasing_output = 1" in text or "jax.buffer_donor" in text
    assert "output_operand_aliases" in text


def test_bad_shapes_are_named():
    qkv, bias, pos, kv, slots = _inputs(4, 14, 2)
    kw = dict(num_heads=14, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"qkv shape \(4, 1152\) != \[T, 1216\]"):
        rope_write_kv(qkv, bias, pos, _CACHE, kv, 0, slots, num_heads=15, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"bias shape \(3,\)"):
        rope_write_kv(qkv, bias[:3], pos, _CACHE, kv, 0, slots, **kw)
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv(qkv, bias, pos[:2], _CACHE, kv, 0, slots, **kw)
    with pytest.raises(ValueError, match="KV heads"):
        rope_write_kv(qkv[:, :1088], bias[:1088], pos, _CACHE, kv, 0, slots, num_heads=15,
                      num_kv_heads=1)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        rope_write_kv(qkv, bias, pos, _CACHE, kv, 3, slots, **kw, backend="interpret")
