"""The CPU paged attention kernel (jaxllm/model_executor/layers/cpu_attention.cc), the CPU
engine's attention, against the naive float64 numpy model of test_paged_attention.py: ragged
queries, prefill chunks on cached context, padding rows and sequences, shuffled blocks, every
Qwen2 head ratio, block sizes 16 and 32, head_dim 32 to 128, logits large enough to underflow
exp. Also that a token's result does not depend on the step it is in, and which steps the model
gives it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxllm.model_executor.layers import cpu_attention, cpu_ffi
from tests.attention_cases import HEAD_CONFIGS, cases, naive_attention, pad_case

if jax.default_backend() != "cpu":
    pytest.skip("the CPU kernel runs on JAX's CPU backend", allow_module_level=True)
if not cpu_attention.available():  # visible, never a silent pass: the suite's machines have g++
    pytest.skip("no C++ compiler to build the CPU kernel", allow_module_level=True)

# isa: the kernel's build (the cpu_isa fixture: native and, on x86, AVX2).
_kernel = jax.jit(cpu_attention.paged_attention, static_argnums=(2,),
                  static_argnames=("scale", "isa"))


def _case(rng, heads, kv_heads, head_dim, block_size, q_lens, seq_lens, extra_rows=3,
          q_scale=1.0, layers=2):
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 5
    width = max(-(-n // block_size) for n in seq_lens) + 2
    kv = rng.standard_normal((layers, 2, kv_heads, num_blocks, block_size, head_dim))
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(seq_lens), width), np.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        k = -(-n // block_size)
        tables[s, :k] = perm[used:used + k]
        tables[s, k:] = rng.integers(0, num_blocks, width - k)  # stale entries: never read
        used += k
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]) + extra_rows, heads, head_dim)) * q_scale
    return (q.astype(np.float32), kv.astype(np.float32), tables,
            np.asarray(seq_lens, np.int32), qsl)


def _check(q, kv, tables, seq_lens, qsl, layer, scale, isa):
    args = (jnp.asarray(q), jnp.asarray(kv), layer, jnp.asarray(tables), jnp.asarray(seq_lens),
            jnp.asarray(qsl))
    want = naive_attention(q, kv, layer, tables, seq_lens, qsl, scale)
    got = np.asarray(_kernel(*args, scale=scale, isa=isa))
    assert got.dtype == np.float32 and got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(got[int(qsl[-1]):], 0.0)  # padding rows


@pytest.mark.parametrize("heads,kv_heads", HEAD_CONFIGS)
def test_decode_matches_float64(heads, kv_heads, rng, cpu_isa):
    """One query per sequence (a decode step), contexts from 1 key to several blocks, a
    padding sequence (no queries, length 0) among them."""
    args = _case(rng, heads, kv_heads, 64, 16, [1, 1, 0, 1, 1], [1, 16, 0, 17, 150])
    for layer in (0, 1):
        _check(*args, layer, 64 ** -0.5, cpu_isa)


@pytest.mark.parametrize("head_dim,block_size", [(64, 32), (128, 16), (128, 32), (32, 16),
                                                  (256, 16), (208, 16)])
def test_ragged_queries_head_dims_and_blocks(head_dim, block_size, rng, cpu_isa):
    """A verify-like step: several queries per sequence, each seeing keys up to its own
    position; blocks of 32 keys are read 16 at a time. Head dims past what a build holds in
    registers (128 with AVX2, 256) read the rest of each key row from memory."""
    args = _case(rng, 12, 2, head_dim, block_size, [3, 1, 6, 2, 4], [5, 40, 100, 2, 67])
    _check(*args, 1, head_dim ** -0.5, cpu_isa)


@settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # cpu_isa: a constant
@given(case=cases())
def test_engine_like_buckets_match_float64(case, cpu_isa):
    """Random steps of up to 40 queries per sequence (decode, verify-like, prefill chunks on
    cached context), inside an engine-like padded bucket: padding rows and
    sequence slots, a wide table of stale block ids, stale blocks of large values."""
    c = pad_case(case, num_tokens=case.q.shape[0] + 7, num_seqs=case.seq_lens.shape[0] + 3,
                 width=64, num_blocks=case.kv.shape[3] + 9)
    _check(c.q, c.kv, c.block_tables, c.seq_lens, c.qsl, c.layer, c.scale, cpu_isa)


def test_large_logits_underflow_cleanly(rng, cpu_isa):
    """Logits spread over hundreds: most exponentials underflow to 0, the softmax stays a
    weighted mean of the values (no inf or nan)."""
    args = _case(rng, 14, 2, 64, 16, [1, 2, 1], [33, 90, 200], q_scale=40.0)
    _check(*args, 0, 1.0, cpu_isa)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunks_match_float64(block_size, rng, cpu_isa):
    """Prefill chunks longer than a query tile, one from position 0 and one on cached context
    (a later chunk), beside decodes."""
    args = _case(rng, 14, 2, 64, block_size, [70, 1, 37, 1], [70, 20, 37 + 45, 130])
    _check(*args, 1, 64 ** -0.5, cpu_isa)


def test_a_token_does_not_depend_on_its_step(rng, cpu_isa):
    """A token gives bit-identical attention alone (a decode step), beside other decodes, inside
    a prefill chunk at any offset (a preempted request recomputed, a chunk split differently)
    and beside a long prefill: the engine's results must not depend on the batch."""
    q, kv, tables, seq_lens, _ = _case(rng, 14, 2, 64, 16, [40, 1], [90, 33])
    pos = 70  # the token under test: sequence 0's query at position 70

    def run(chunks):
        """chunks: (sequence, first position, queries) per sequence of the step, each taking
        sequence 0's query rows by position (so the token's q row is always the same)."""
        rows, lens, qls = [], [], []
        for s, first, n in chunks:
            rows.append(q[np.arange(first, first + n) % q.shape[0]] if s == 0 else q[-1:])
            lens.append(first + n)
            qls.append(n)
        qsl = np.concatenate([[0], np.cumsum(qls)]).astype(np.int32)
        out = _kernel(jnp.asarray(np.concatenate(rows)), jnp.asarray(kv), 0,
                      jnp.asarray(tables[[c[0] for c in chunks]]),
                      jnp.asarray(np.asarray(lens, np.int32)), jnp.asarray(qsl), scale=0.125,
                      isa=cpu_isa)
        return np.asarray(out)

    alone = run([(0, pos, 1)])[0]
    np.testing.assert_array_equal(run([(1, 32, 1), (0, pos, 1)])[1], alone)
    for first in (0, 3, 64, 69, 70):
        n = pos + 5 - first
        np.testing.assert_array_equal(run([(0, first, n)])[pos - first], alone)
        np.testing.assert_array_equal(run([(1, 32, 1), (0, first, n)])[1 + pos - first], alone)


@pytest.mark.skipif(not cpu_ffi.runs_here("avx2"), reason="this CPU cannot run the avx2 build")
def test_builds_give_the_same_bits(rng):
    """The AVX2 build (other register tiles) gives the native build's results bit for bit:
    head dims that fit its registers and ones that do not, decodes and prefill chunks."""
    for head_dim in (64, 128, 256):
        q, kv, tables, seq_lens, qsl = _case(rng, 14, 2, head_dim, 16, [1, 9, 40],
                                             [70, 33, 90])
        args = (jnp.asarray(q), jnp.asarray(kv), 1, jnp.asarray(tables), jnp.asarray(seq_lens),
                jnp.asarray(qsl))
        np.testing.assert_array_equal(np.asarray(_kernel(*args, scale=0.1, isa="avx2")),
                                      np.asarray(_kernel(*args, scale=0.1, isa="native")))


def test_bad_shapes_are_named(rng):
    q, kv, tables, seq_lens, qsl = _case(rng, 14, 2, 64, 16, [1], [5])
    with pytest.raises(ValueError, match="D a multiple of 16"):
        cpu_attention.paged_attention(jnp.asarray(q[..., :40]), jnp.asarray(kv[..., :40]), 0,
                                      tables, seq_lens, qsl, scale=1.0)
    with pytest.raises(ValueError, match=r"layer 2 out of range \[0, 2\)"):
        cpu_attention.paged_attention(jnp.asarray(q), jnp.asarray(kv), 2, tables, seq_lens, qsl,
                                      scale=1.0)


def test_which_steps_use_it():
    """The config picks the kernel for a float32 cache, the reference backend, the CPU platform
    and one device; a bfloat16 cache, a Pallas backend, a GPU or tensor parallelism run the
    kernel backend's attention, and so does a model whose head size the kernel does not take."""
    from jaxllm.config import resolve_attention_impl
    from jaxllm.model_executor.layers.attention import CPU_KERNEL, attention_impl

    assert resolve_attention_impl("reference", "cpu", "float32", 1) == CPU_KERNEL
    assert resolve_attention_impl("interpret", "cpu", "float32", 1) == "interpret"
    assert resolve_attention_impl("reference", "cpu", "float32", 2) == "reference"
    assert resolve_attention_impl("reference", "cpu", "bfloat16", 1) == "reference"
    assert resolve_attention_impl("reference", "gpu", "float32", 1) == "reference"
    assert resolve_attention_impl("pallas", "gpu", "bfloat16", 1) == "pallas"
    assert attention_impl(CPU_KERNEL, "reference", 64) == CPU_KERNEL
    assert attention_impl(CPU_KERNEL, "reference", 40) == "reference"
    assert attention_impl(CPU_KERNEL, "reference", 512) == "reference"
    assert attention_impl("interpret", "interpret", 40) == "interpret"
