"""write_kv: scatter semantics, interpret == reference, and in-place updates under donation."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.common import lower_for_cuda
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from tests.kernel_backends import KERNEL_BACKENDS

_jitted = jax.jit(write_kv, static_argnums=(1,), static_argnames=("backend",))


def expected_write(kv, layer, k, v, slots):
    out = np.array(kv, copy=True)
    block_size = kv.shape[4]
    for t, s in enumerate(slots):
        if s >= 0:
            out[layer, 0, :, s // block_size, s % block_size] = k[t]
            out[layer, 1, :, s // block_size, s % block_size] = v[t]
    return out


def make_inputs(num_tokens, *, num_layers=3, num_kv_heads=2, num_blocks=12, block_size=16,
                head_dim=64, num_padding=3, seed=0):
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim))
    k = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    v = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    # distinct slots anywhere in the cache (first and last slot included when there is room)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    if num_tokens >= 2:
        slots[0], slots[-1] = 0, num_blocks * block_size - 1
    slots[rng.permutation(num_tokens)[:num_padding]] = -1
    return kv.astype(np.float32), k.astype(np.float32), v.astype(np.float32), slots


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_scatter_padding_and_other_layers(backend):
    kv, k, v, slots = make_inputs(21, num_padding=4)
    out = np.asarray(_jitted(jnp.asarray(kv), 1, k, v, jnp.asarray(slots), backend=backend))
    want = expected_write(kv, 1, k, v, slots)
    np.testing.assert_array_equal(out, want)
    # layers 0 and 2 are bit-identical, and only the 17 real tokens' slots changed in layer 1
    np.testing.assert_array_equal(out[[0, 2]], kv[[0, 2]])
    changed = np.any(out[1] != kv[1], axis=(0, 1, 4))  # [num_blocks, block_size]
    assert changed.sum() == (slots >= 0).sum()


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_all_padding_writes_nothing(backend):
    kv, k, v, _ = make_inputs(8)
    slots = jnp.full((8,), -1, jnp.int32)
    out = np.asarray(_jitted(jnp.asarray(kv), 2, k, v, slots, backend=backend))
    np.testing.assert_array_equal(out, kv)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_bf16_cache(backend):
    kv, k, v, slots = make_inputs(5, num_padding=1)
    kv16 = jnp.asarray(kv, jnp.bfloat16)
    out = _jitted(kv16, 0, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16),
                  jnp.asarray(slots), backend=backend)
    assert out.dtype == jnp.bfloat16
    want = expected_write(np.asarray(kv16.astype(jnp.float32)), 0,
                          np.asarray(jnp.asarray(k, jnp.bfloat16).astype(jnp.float32)),
                          np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)), slots)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_tokens=st.integers(1, 40), num_kv_heads=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([64, 128]), block_size=st.sampled_from([16, 32]),
       layer=st.integers(0, 1), seed=st.integers(0, 2**16), data=st.data())
def test_kernel_matches_reference(backend, num_tokens, num_kv_heads, head_dim, block_size, layer,
                                  seed, data):
    num_padding = data.draw(st.integers(0, num_tokens))
    kv, k, v, slots = make_inputs(num_tokens, num_layers=2, num_kv_heads=num_kv_heads,
                                  num_blocks=-(-num_tokens // block_size) + 2,
                                  block_size=block_size, head_dim=head_dim,
                                  num_padding=num_padding, seed=seed)
    args = (jnp.asarray(kv), layer, k, v, jnp.asarray(slots))
    ref = np.asarray(_jitted(*args, backend="reference"))
    out = np.asarray(_jitted(*args, backend=backend))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(ref, expected_write(kv, layer, k, v, slots))


@pytest.mark.parametrize("backend", ["reference", *KERNEL_BACKENDS])
def test_traced_layer_one_compilation_for_every_layer(backend):
    # The layer as a traced scalar (and as a one-element array): one compiled function writes
    # each layer, exactly where the static-layer oracle says, and leaves the others alone.
    kv, k, v, slots = make_inputs(21, num_padding=4)
    fn = jax.jit(functools.partial(write_kv, backend=backend))
    for layer in (2, 0, 1):
        out = np.asarray(fn(jnp.asarray(kv), jnp.int32(layer), k, v, jnp.asarray(slots)))
        np.testing.assert_array_equal(out, expected_write(kv, layer, k, v, slots))
    assert fn._cache_size() == 1
    out = np.asarray(fn(jnp.asarray(kv), jnp.array([1], jnp.int32), k, v, jnp.asarray(slots)))
    np.testing.assert_array_equal(out, expected_write(kv, 1, k, v, slots))


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_bad_layer_is_refused(backend):
    kv, k, v, slots = make_inputs(4)
    with pytest.raises(ValueError, match="layer 3 out of range for a KV array of 3 layers"):
        write_kv(jnp.asarray(kv), 3, k, v, jnp.asarray(slots), backend=backend)
    with pytest.raises(ValueError, match="layer -1 out of range"):
        write_kv(jnp.asarray(kv), -1, k, v, jnp.asarray(slots), backend=backend)
    with pytest.raises(ValueError, match="one-element integer array, got float32"):
        write_kv(jnp.asarray(kv), jnp.float32(1), k, v, jnp.asarray(slots), backend=backend)
    with pytest.raises(ValueError, match=r"one-element integer array, got int32\[2\]"):
        write_kv(jnp.asarray(kv), jnp.array([0, 1]), k, v, jnp.asarray(slots), backend=backend)


def test_unknown_backend():
    kv, k, v, slots = make_inputs(4)
    with pytest.raises(ValueError, match="cuda"):
        write_kv(jnp.asarray(kv), 0, k, v, jnp.asarray(slots), backend="cuda")


# --- In-place updates --------------------------------------------------------------------------

NUM_LAYERS, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM, HEADS = 2, 2, 256, 16, 64, 14
CACHE_SHAPE = (NUM_LAYERS, 2, KV_HEADS, NUM_BLOCKS, BLOCK, HEAD_DIM)
CACHE_BYTES = int(np.prod(CACHE_SHAPE)) * 4


def toy_step(kv_cache, x, slots, block_tables, seq_lens, qsl, *, backend="reference"):
    """Two layers of write_kv then paged_attention, each layer's K/V computed from the previous
    layer's attention output, as in the real model.

    That data dependence matters: with K/V of layer 1 independent of layer 0's attention, XLA
    cannot order layer 1's scatter after layer 0's cache reads and copies the whole cache to
    keep both alive (we saw two full copies in that variant). A real model always has it.
    """
    for layer in range(NUM_LAYERS):
        k = x[:, :KV_HEADS] * 0.5
        v = x[:, KV_HEADS:2 * KV_HEADS] + 1.0
        kv_cache = write_kv(kv_cache, layer, k, v, slots, backend=backend)
        x = paged_attention(x, kv_cache, layer, block_tables, seq_lens, qsl, scale=0.125,
                            max_query_len=8, backend=backend)
    return x, kv_cache


def toy_args(num_tokens=16, num_seqs=4):
    return (jax.ShapeDtypeStruct(CACHE_SHAPE, jnp.float32),
            jax.ShapeDtypeStruct((num_tokens, HEADS, HEAD_DIM), jnp.float32),
            jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs, 8), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
            jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))


# (1, 1) is the batch-1 decode bucket: XLA rewrites a one-index scatter into a
# dynamic-update-slice, which once cost 72 whole-cache copies per step of the real model.
@pytest.mark.parametrize("num_tokens, num_seqs", [(16, 4), (2, 2), (1, 1)])
def test_donated_step_updates_cache_in_place(num_tokens, num_seqs):
    """Compiled for this CPU, a donated step must reuse the cache buffer, not copy it.

    Three independent signals, so neither an HLO printing change nor a fusion renaming can make
    the test pass vacuously:
    1. the module header aliases parameter 0 (the cache) to output {1} (the new cache);
    2. XLA's own buffer accounting: the aliased bytes are the whole cache, and the temporaries
       are far smaller than one cache (a copy would need a full cache-sized temporary; the
       cache is 8 MiB here, everything else in the step well under 2 MiB);
    3. no `copy` instruction in the optimized HLO produces an array of the cache's shape.
    """
    compiled = jax.jit(toy_step, donate_argnums=0).lower(*toy_args(num_tokens, num_seqs)).compile()
    text = compiled.as_text()
    header = next(line for line in text.splitlines() if line.startswith("HloModule"))
    assert re.search(r"input_output_alias=\{ \{1\}: \(0, \{\}", header), header

    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == CACHE_BYTES
    # A copy of the cache would need at least CACHE_BYTES of temporaries; what the step does
    # need (attention's gathered key tiles, a fixed ~2.5 MB here) stays well below that.
    assert stats.temp_size_in_bytes < CACHE_BYTES // 2, stats.temp_size_in_bytes

    shape = "f32[" + ",".join(map(str, CACHE_SHAPE)) + "]"
    copies = [line for line in text.splitlines()
              if re.search(rf"= {re.escape(shape)}\S* copy\(", line)]
    assert not copies, copies


def test_donated_step_runs_and_matches_undonated():
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(CACHE_SHAPE).astype(np.float32)
    x = rng.standard_normal((16, HEADS, HEAD_DIM)).astype(np.float32)
    slots = np.concatenate([np.arange(40, 52), [-1] * 4]).astype(np.int32)
    bt = np.tile(np.arange(8, dtype=np.int32), (4, 1))
    seq_lens = np.array([44, 46, 52, 0], np.int32)  # ctx 40 + 4, +2, +6 new tokens; padding
    qsl = np.array([0, 4, 6, 12, 12], np.int32)
    args = (x, slots, bt, seq_lens, qsl)
    want_x, want_kv = jax.jit(toy_step)(jnp.asarray(kv), *args)
    got_x, got_kv = jax.jit(toy_step, donate_argnums=0)(jnp.asarray(kv), *args)
    np.testing.assert_array_equal(np.asarray(got_kv), np.asarray(want_kv))
    np.testing.assert_array_equal(np.asarray(got_x), np.asarray(want_x))


def test_pallas_lowering_aliases_cache():
    """For CUDA (lowered without a GPU): the write_kv custom call aliases its cache operand to
    its result, and the donated cache argument is marked as aliasing the cache output."""
    lowered = lower_for_cuda(lambda *a: toy_step(*a, backend="pallas"), toy_args(),
                             donate_argnums=0)
    text = lowered.as_text()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    writes = [c for c in calls if "write_kv" in c]
    assert len(writes) == NUM_LAYERS, calls
    for call in writes:
        assert "output_operand_aliases" in call, call[:300]
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "tf.aliasing_output = 1" in main, main[:400]
