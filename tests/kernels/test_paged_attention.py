"""paged_attention: reference and Pallas kernel (interpret mode; native on a GPU) vs an
independent numpy model, kernel vs reference in bf16.

The numpy model is deliberately naive: per sequence, per query, per head, it rebuilds the
sequence's context in logical order from its block table and runs a dense causal softmax in
float64. It shares no code with the module under test. The reference is checked on exact
shapes and inside engine-like buckets (padded tokens, sequence slots, a 32k-wide block table):
its cost must not depend on that padding, and neither may its answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import reference_attention
from pallas_kernels.attention_common import decode_num_splits, launch_config
from pallas_kernels.common import next_pow2
from pallas_kernels.paged_attention import paged_attention
from tests.attention_cases import cases, make_case, naive_attention, pad_case
from tests.kernel_backends import KERNEL_BACKENDS

# The reference is what the engine runs on CPU, always on padded bucket shapes. The unit tests
# run it inside one engine-like bucket: 512 tokens, 64 sequence slots, a table max_model_len
# wide (2048 blocks = 32k tokens of 16), 1024 physical blocks, and max_query_len as the engine
# passes it (T, or 1 for pure decode). Besides checking that padding costs nothing in
# correctness, the tests then share a few compilations instead of compiling one per case.
BUCKET = dict(num_tokens=512, num_seqs=64, width=2048, num_blocks=1024)


def check(case, backend, dtype=jnp.float32, tol=1e-5, max_query_len="case", bucket=None,
          num_splits=1):
    """Run ``case`` (inside ``bucket`` when given, see BUCKET) and compare with the naive model;
    every row past the real tokens must be zeros."""
    run = case if bucket is None else pad_case(case, **bucket)
    if bucket is not None and max_query_len == "case":
        max_query_len = bucket["num_tokens"] if case.max_query_len > 1 else 1
    out = np.asarray(run.run(backend, dtype, max_query_len, num_splits).astype(jnp.float32))
    assert out.shape == run.q.shape
    assert np.isfinite(out).all()
    total = int(case.qsl[-1])
    np.testing.assert_allclose(out[:total], case.expected(dtype)[:total], rtol=tol, atol=tol)
    assert (out[total:] == 0).all()  # padding rows: zeros
    return out


SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Random cases have at most 5 + 2 sequences, 5 x 48 + 9 tokens and 198 + 48 keys each.
HYPOTHESIS_BUCKET = dict(num_tokens=256, num_seqs=8, width=32, num_blocks=96)


@SETTINGS
@given(cases(max_seqs=5, max_q=48, max_ctx=150), st.booleans())
def test_reference_matches_numpy(case, in_bucket):
    # Exact shapes, or the case inside a bucket (cases with the same head configuration and
    # block size then share one compilation).
    check(case, "reference", bucket=HYPOTHESIS_BUCKET if in_bucket else None)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernel_matches_numpy(backend, case):
    check(case, backend)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_seqs=3, max_q=24, max_ctx=60))
def test_kernel_matches_reference_bf16(backend, case):
    # bf16: the kernel feeds bf16 q/k into the QK matmul and rounds the softmax weights p to
    # bf16 before the PV matmul (as a GPU flash kernel does), then rounds the output to bf16;
    # the reference upcasts everything to f32. Each rounding is ~2^-8 relative, on outputs of
    # magnitude <~3, so 2e-2 absolute/relative is a few bf16 ulps, not a loose bound.
    ref = np.asarray(case.run("reference", jnp.bfloat16).astype(jnp.float32))
    out = np.asarray(case.run(backend, jnp.bfloat16).astype(jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    # and both stay close to the exact answer on the bf16-rounded inputs
    total = int(case.qsl[-1])
    np.testing.assert_allclose(ref[:total], case.expected(jnp.bfloat16)[:total], rtol=2e-2,
                               atol=2e-2)


BACKENDS = ["reference", *KERNEL_BACKENDS]


def bucket_for(backend, **overrides):
    """The reference runs inside BUCKET (see there), the Pallas kernel on the exact shapes."""
    return dict(BUCKET, **overrides) if backend == "reference" else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_length_one(backend):
    # seq_len 1: a one-token prompt, i.e. one query at position 0 seeing only itself
    check(make_case([(0, 1)], pad_tokens=3), backend, bucket=bucket_for(backend))
    check(make_case([(0, 1), (1, 1)], pad_tokens=1), backend, bucket=bucket_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_exact_block_multiples(backend, block_size):
    seqs = [(0, 2 * block_size), (block_size, block_size), (3 * block_size - 1, 1)]
    check(make_case(seqs, block_size=block_size), backend, bucket=bucket_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_partly_filled_last_block_and_many_blocks(backend):
    # 7 blocks of 16 in random physical order, last one holds 5 of 16 tokens
    check(make_case([(100, 1), (90, 11)], block_size=16, extra_blocks=10, seed=3), backend,
          bucket=bucket_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_padding_rows_finite(backend):
    case = make_case([(5, 3)], pad_tokens=29, pad_seqs=3)
    out = check(case, backend, bucket=bucket_for(backend))
    assert (out[3:] == 0).all()
    # a batch that is padding only (warm-up shapes): every row zeros
    out = check(make_case([(0, 0)], pad_tokens=8, pad_seqs=2), backend,
                bucket=bucket_for(backend))
    assert (out == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_and_decode(backend):
    seqs = [(37, 1), (0, 23), (12, 1), (40, 9), (64, 1)]
    check(make_case(seqs, pad_tokens=5, pad_seqs=1, seed=7), backend, bucket=bucket_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_length_sequence_between_real_ones(backend):
    check(make_case([(3, 4), (0, 0), (9, 1), (0, 5)], seed=11), backend,
          bucket=bucket_for(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(14, 2, 64), (12, 2, 128), (28, 4, 128)])
def test_qwen2_head_ratios(backend, num_heads, num_kv_heads, head_dim):
    seqs = [(20, 1), (0, 17), (33, 6)]
    # (head_dim 128: a smaller cache in the bucket, 1024 blocks of 32 x 128 are 0.3 GB here)
    check(make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    block_size=32, pad_tokens=2, seed=num_heads), backend,
          bucket=bucket_for(backend, **({"num_blocks": 64} if head_dim == 128 else {})))


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_query_len_none_and_loose_bound(backend):
    case = make_case([(10, 1), (0, 13), (4, 6)], pad_tokens=4)
    bucket = bucket_for(backend)
    a = check(case, backend, max_query_len=None, bucket=bucket)
    # a bound above the real maximum (in the bucket: the engine's T, a shared compilation)
    b = check(case, backend, max_query_len=32 if bucket is None else "case", bucket=bucket)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (12, 2, 128)])
def test_spec_decode_verify_step(backend, dtype, num_heads, num_kv_heads, head_dim):
    # The verify step of speculative decoding: every sequence computes 1 + k = 6 tokens (its
    # next token and 5 drafts) on top of its context, at max_query_len 6, as the runner's
    # spec-decode bucket runs it: padding sequences and token rows after the real ones. The
    # kernel's query tile comes from max_query_len: 8 tokens (bfloat16: one tile per sequence,
    # 2 rows masked) or 4 (float32: a full tile and a half one). Contexts put the 6 queries
    # inside a block, across block and key-tile (32, 64) boundaries and ending on one.
    contexts = [1, 13, 58, 63, 64, 130]
    group_pad = next_pow2(num_heads // num_kv_heads)
    assert launch_config(group_pad, 6, head_dim, dtype)[0] == (8 if dtype == jnp.bfloat16 else 4)
    case = make_case([(c, 6) for c in contexts], num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, pad_tokens=12, pad_seqs=2, seed=head_dim + 43)
    assert case.max_query_len == 6
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    out = check(case, backend, dtype, tol=tol, max_query_len=6,
                bucket=bucket_for(backend, **({"num_blocks": 64} if head_dim == 128 else {})))
    if dtype == jnp.bfloat16 and backend != "reference":  # within a few ulps of the reference
        ref = np.asarray(case.run("reference", dtype).astype(jnp.float32))
        np.testing.assert_allclose(out[:len(ref)], ref, rtol=tol, atol=tol)


def split_decode_lengths(num_splits, block_k, block_size=16):
    """Decode context lengths around the edges of split-K decode with ``num_splits`` splits of
    key tiles of ``block_k`` keys: 1 (one split busy, the rest empty), one block, one tile per
    split (num_splits x KB, -1 and +1: the per-split run goes from 1 to 2 tiles), runs that
    leave the last splits empty or short (5 tiles, 2 x splits + 1 tiles), odd block counts
    (7 and 9 blocks, full and partial) and 4096."""
    edge = num_splits * block_k
    return [1, block_size, edge - 1, edge, edge + 1, 5 * block_k - 3, (2 * num_splits + 1) *
            block_k, 7 * block_size, 9 * block_size - 5, 4096]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype,num_splits", [(jnp.float32, 2), (jnp.float32, 4),
                                              (jnp.float32, 8), (jnp.bfloat16, 8)],
                         ids=["f32-2", "f32-4", "f32-8", "bf16-8"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(14, 2, 64), (28, 4, 128)])
def test_split_k_decode(backend, dtype, num_splits, num_heads, num_kv_heads, head_dim):
    # One batched decode step (max_query_len 1) over the edge lengths, plus a padding sequence
    # and padding token rows: split-K against the unsplit reference, float32 also against the
    # numpy model. Tolerances as in the tests above (bf16: a few ulps).
    block_k = launch_config(next_pow2(num_heads // num_kv_heads), 1, head_dim, dtype)[1]
    lengths = split_decode_lengths(num_splits, block_k)
    seqs = [(n - 1, 1) for n in lengths]
    seqs.insert(3, (0, 0))  # a padding sequence among real ones
    case = make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     pad_tokens=3, pad_seqs=1, seed=num_splits + head_dim)
    out = np.asarray(case.run(backend, dtype, 1, num_splits).astype(jnp.float32))
    assert np.isfinite(out).all()
    total = int(case.qsl[-1])
    assert (out[total:] == 0).all()
    ref = np.asarray(case.run("reference", dtype, 1).astype(jnp.float32))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    if dtype == jnp.float32:
        np.testing.assert_allclose(out[:total], case.expected()[:total], rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_split_k_decode_short_contexts_many_splits(backend):
    # 16 splits of contexts of 1..3 keys (all but the first split empty) and a batch that is
    # padding only: finite, exact, zeros where padding.
    case = make_case([(0, 1), (1, 1), (2, 1)], pad_tokens=2, pad_seqs=2, seed=37)
    out = check(case, backend, max_query_len=1, num_splits=16)
    np.testing.assert_allclose(out, np.asarray(case.run(backend, max_query_len=1)), rtol=1e-6,
                               atol=1e-6)
    out = np.asarray(make_case([(0, 0)], pad_tokens=4, pad_seqs=1).run(backend, jnp.float32, 1,
                                                                        16))
    assert (out == 0).all()


def test_split_k_argument_checks():
    case = make_case([(4, 1)])
    for bad in (0, 3, 6):
        with pytest.raises(ValueError, match="power of two"):
            case.run("reference", max_query_len=1, num_splits=bad)
    with pytest.raises(ValueError, match="max_query_len"):
        case.run("interpret", max_query_len=2, num_splits=2)
    # The reference computes the same attention unsplit.
    np.testing.assert_array_equal(np.asarray(case.run("reference", max_query_len=1, num_splits=4)),
                                  np.asarray(case.run("reference", max_query_len=1)))


def test_decode_num_splits_rule():
    # Enough (sequence, KV head) programs already: no split.
    assert decode_num_splits(32768, 128, 2) == 1
    assert decode_num_splits(32768, 64, 4) == 1
    # Small batches: the smallest power of two filling 132 SMs once...
    assert decode_num_splits(32768, 1, 2) == 16  # capped at max_splits
    assert decode_num_splits(32768, 8, 4) == 8  # 32 programs x 8 = 256 >= 132 (x 4 = 128)
    assert decode_num_splits(32768, 40, 2) == 2
    # ... and no split shorter than min_split_len keys at max_model_len.
    assert decode_num_splits(1024, 1, 2) == 4
    assert decode_num_splits(256, 1, 2) == 1
    assert decode_num_splits(4096, 8, 2, num_sms=108) == 8


def check_bucket(seqs, seed, max_query_len="case"):
    """The real batch ``seqs`` inside BUCKET, checked against the naive model."""
    return check(make_case(seqs, seed=seed), "reference", max_query_len=max_query_len,
                 bucket=BUCKET)


def test_reference_small_tiles(monkeypatch):
    # Tiles of one block, groups of two tokens, query tiles of three tokens: every loop runs
    # many iterations and tiles end mid-sequence; same answer as the naive model.
    case = make_case([(30, 40), (5, 1), (0, 26), (17, 1), (50, 2), (0, 3), (33, 4)],
                     pad_tokens=3, pad_seqs=1, seed=5)
    monkeypatch.setattr(reference_attention, "_REF_KEY_TILE", 16)
    monkeypatch.setattr(reference_attention, "_REF_TOKEN_GROUP", 2)
    monkeypatch.setattr(reference_attention, "_REF_QUERY_TILE", 3)
    fn = jax.jit(lambda *a: paged_attention(*a[:2], case.layer, *a[3:], scale=case.scale,
                                            max_query_len=case.max_query_len))
    out = np.asarray(fn(*case.args()))
    total = int(case.qsl[-1])
    np.testing.assert_allclose(out[:total], case.expected()[:total], rtol=1e-5, atol=1e-5)
    assert (out[total:] == 0).all()


def test_reference_contexts_across_key_tiles():
    # Contexts and prefill chunks that start, end and straddle key tiles (128 keys) and query
    # tiles (32 tokens) at and around their boundaries; decodes (q_len 1..3) and tiled
    # prefills (q_len >= 4) in one step, in a wide table with many padding slots.
    seqs = [(126, 1), (127, 1), (128, 1), (255, 2), (256, 3), (0, 129), (95, 33), (127, 4),
            (200, 31), (1, 1)]
    check_bucket(seqs, seed=13)


def test_reference_many_sequences_max_query_len_t():
    # What the engine passes for any step with a prefill: max_query_len = T, here with 40
    # sequences (decodes, short prefills, prefix-hit chunks).
    rng = np.random.default_rng(17)
    seqs = []
    for i in range(40):
        if i % 4 < 2:
            seqs.append((int(rng.integers(0, 300)), 1))
        elif i % 4 == 2:
            seqs.append((0, int(rng.integers(2, 12))))
        else:
            seqs.append((int(rng.integers(1, 200)), int(rng.integers(2, 40))))
    check_bucket(seqs, seed=17)


def test_reference_huge_table_short_contexts():
    # Contexts of a few blocks in a table 2048 blocks wide; pure decode too (max_query_len 1).
    check_bucket([(3, 1), (40, 1), (0, 21), (17, 6)], seed=19)
    check_bucket([(3, 1), (40, 1), (0, 1), (17, 1), (200, 1)], seed=19, max_query_len=1)


def test_reference_padding_invariance():
    # Same real inputs, exact shapes vs the bucket (T, S, table width and cache all grown).
    base = make_case([(70, 1), (0, 45), (3, 1), (129, 9), (12, 2)], seed=23)
    total = int(base.qsl[-1])
    small = check(base, "reference")
    big = check(base, "reference", bucket=BUCKET)
    np.testing.assert_allclose(big[:total], small[:total], rtol=1e-6, atol=1e-6)


def test_reference_max_query_len_is_only_a_hint():
    # A pure-decode bound (1) passed for a step with prefills: the tile pass is not compiled,
    # every token takes the token pass, and the answer is still exact.
    check_bucket([(10, 1), (0, 13), (4, 6), (0, 40)], seed=29, max_query_len=1)


def test_reference_all_padding_bucket():
    # Warm-up shapes: nothing real in the bucket, max_query_len T or 1.
    for mq in (BUCKET["num_tokens"], 1):
        out = check(make_case([(0, 0)], seed=31), "reference", max_query_len=mq, bucket=BUCKET)
        assert (out == 0).all()


def test_jit_with_static_layer():
    case = make_case([(10, 1), (0, 9)], pad_tokens=2)
    fn = jax.jit(lambda *a: paged_attention(*a[:2], 1, *a[2:], scale=case.scale,
                                            max_query_len=case.max_query_len))
    q, kv, _, bt, sl, qsl = case.args()
    out = np.asarray(fn(q, kv, bt, sl, qsl))
    np.testing.assert_allclose(out[:10], case.expected()[:10], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_traced_layer_one_compilation_for_every_layer(backend, num_splits):
    # The layer as a traced scalar: one compiled function reads each layer of a 3-layer cache
    # (unsplit, and split-K decode), matching the naive model of that layer.
    seqs = [(10, 1), (70, 1), (33, 1)] if num_splits > 1 else [(10, 1), (0, 9), (20, 4)]
    case = make_case(seqs, num_layers=3, pad_tokens=2, pad_seqs=1, seed=41)
    mq = 1 if num_splits > 1 else case.max_query_len
    fn = jax.jit(lambda q, kv, layer, *a: paged_attention(
        q, kv, layer, *a, scale=case.scale, max_query_len=mq, backend=backend,
        num_splits=num_splits))
    q, kv, _, bt, sl, qsl = case.args()
    total = int(case.qsl[-1])
    outs = []
    for layer in (2, 0, 1):
        out = np.asarray(fn(q, kv, jnp.int32(layer), bt, sl, qsl))
        want = naive_attention(case.q, case.kv, layer, case.block_tables, case.seq_lens,
                               case.qsl, case.scale)
        np.testing.assert_allclose(out[:total], want[:total], rtol=1e-5, atol=1e-5)
        assert (out[total:] == 0).all()
        outs.append(out)
    assert fn._cache_size() == 1
    assert not np.allclose(outs[0], outs[1])  # the layers' K/V differ, so must the outputs


def test_bad_layer_is_refused():
    case = make_case([(4, 1)])
    q, kv, _, bt, sl, qsl = case.args()
    for backend in ("reference", "interpret"):
        with pytest.raises(ValueError, match="layer 2 out of range for a KV array of 2 layers"):
            paged_attention(q, kv, 2, bt, sl, qsl, scale=case.scale, backend=backend)
        with pytest.raises(ValueError, match="one-element integer array, got float32"):
            paged_attention(q, kv, jnp.float32(0), bt, sl, qsl, scale=case.scale,
                            backend=backend)


def test_unknown_backend():
    case = make_case([(0, 1)])
    with pytest.raises(ValueError, match="triton"):
        case.run("triton")
