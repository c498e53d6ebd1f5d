"""Paged attention over a ragged batch that mixes prefill and decode.

Layout and metadata (shared with ``kv_write`` and the engine)::

    q:               [T, num_heads, head_dim]       T is a padded token bucket
    kv_cache:        [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables:    [S, max_blocks_per_seq] int32  physical block of each logical block
    seq_lens:        [S] int32                      context length including this step's tokens
    query_start_loc: [S+1] int32                    sequence s owns query rows qsl[s]:qsl[s+1]

Query i of sequence s sits at absolute position ``seq_lens[s] - q_len_s + i`` and attends to keys
``0..position``; that one rule covers prefill, chunked prefill on top of cached context (prefix
hits) and decode (q_len 1), so one code path serves any mix of them.

Kernel design (Triton backend). One kernel serves the whole ragged mixed batch, because the
engine schedules decode and prefill chunks into the same step (vLLM V1 style) and a single launch
keeps one static shape per token/sequence bucket; decode is the special case q_len = 1 and gets
its own tile size from the static ``max_query_len`` (1 for a pure decode step).

* Grid ``(S, cdiv(max_query_len, BQ), num_kv_heads)``: one program per (sequence, tile of BQ
  query tokens, KV head). Programs whose tile starts past the sequence's q_len exit at once, so
  the over-provisioned grid for ragged lengths costs a launch slot each, nothing more.
* Grouped-query attention is folded into the matmul M dimension: the G query heads of one KV
  head are padded to Gp = next power of two (7 -> 8, 6 -> 8) and a tile holds BQ tokens x Gp
  heads = M rows, so each K/V block loaded from HBM is used by all heads that share it. Padded
  head rows and rows past q_len are masked on load (zeros) and on store.
* Triton only accepts power-of-two block shapes, so nothing non-power-of-two is ever loaded:
  queries and outputs are addressed with gathered row indices (token, head) straight in
  [T, num_heads, head_dim] (no padded copy of q), K/V with gathered (block, offset) indices so a
  key tile of KB tokens can span several physical blocks of 16 or 32 in arbitrary order; the
  refs themselves (num_blocks, max_blocks_per_seq, T, S) may have any size.
* Keys are walked in tiles of KB up to the causal end of the tile's last query (not the whole
  table), with an online (flash) softmax in float32; logits beyond seq_len or the query's
  position are masked with a finite value so no row ever computes inf - inf. Keys past the end
  are loaded as zeros so stale cache contents cannot leak NaN through p * V.
* Tile sizes: M = BQ x Gp is 128 rows (head_dim 64) or 64 (head_dim 128) for prefill, and for
  a pure decode step (max_query_len 1) BQ = max(1, 16 // Gp), i.e. M = 16, Triton's smallest
  dot tile; KB = 64 keys per step. Every tl.dot is thus >= 16 in M, N and K.
* Precision: bf16 inputs go to the tensor cores as bf16 with float32 accumulation (p is
  rounded to bf16 before P @ V, as in any flash kernel); float32 inputs use IEEE float32 dots
  (Precision.HIGHEST, not TF32) so that they match the reference to ~1e-5.
* Addressing: offsets are 32-bit unless the cache array exceeds 4 GiB, in which case the
  Pallas Triton lowering switches to 64-bit offsets on its own (checked in the lowering cases,
  whose all-layer caches for the larger models are > 4 GiB).
* Rows of padding tokens (>= query_start_loc[-1]) belong to no program; the wrapper zeroes them
  after the call (one cheap select) rather than launching programs just to write zeros.

Not done (future work): splitting long contexts across programs for decode (flash-decoding);
with few sequences a decode step uses only S x num_kv_heads programs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_BACKENDS = ("pallas", "interpret", "reference")

# Finite stand-in for -inf: masked logits must never produce inf - inf = nan.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Budget, in float32 elements, for one chunk of reference attention logits
# [S, num_heads, chunk, L]; larger problems are processed in query chunks so the CPU engine does
# not allocate gigabytes for a long prefill.
_REF_LOGITS_BUDGET = 1 << 25


def _reference_chunk(qc, k, v, seq_lens, q_lens, q_off, scale):
    """qc: [S, C, KVH, G, D] f32 (query rows q_off..q_off+C of each sequence);
    k, v: [S, KVH, L, D] f32. Returns [S, C, KVH, G, D] f32."""
    num_keys = k.shape[2]
    chunk = qc.shape[1]
    ctx = (seq_lens - q_lens)[:, None]  # context already cached before this step's queries
    q_pos = ctx + q_off + jnp.arange(chunk)[None, :]  # [S, C] absolute positions
    key = jnp.arange(num_keys)[None, None, :]
    mask = (key <= q_pos[:, :, None]) & (key < seq_lens[:, None, None])  # [S, C, L]
    # Both matmuls keep (S, KVH) as leading batch dims and produce [S, KVH, G, C, *]: with the
    # output in another order XLA:CPU transposes the big operand (PV was 3x slower).
    qc = qc.transpose(0, 2, 3, 1, 4)  # [S, KVH, G, C, D], small
    logits = jnp.einsum("skgcd,skld->skgcl", qc, k) * scale
    logits = jnp.where(mask[:, None, None], logits, _MASK_VALUE)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(logits - m), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    # Rows with no visible key (padding sequences, rows past q_len) get zeros, not 0/0.
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("skgcl,skld->skgcd", p, v).transpose(0, 3, 1, 2, 4)


def paged_attention_reference(q: jax.Array, kv_cache: jax.Array, layer: int,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              query_start_loc: jax.Array, *, scale: float,
                              max_query_len: int | None = None) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    num_seqs, max_blocks = block_tables.shape
    qmax = num_tokens if max_query_len is None else max(1, min(int(max_query_len), num_tokens))
    seq_lens = seq_lens.astype(jnp.int32)
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]

    # Context K/V in logical order, [S, KVH, L, D]: O(S * L * D), the size of the context itself.
    num_blocks = kv_cache.shape[3]

    def gather(which):
        # Whole blocks are contiguous rows of block_size * head_dim elements, so gathering rows
        # runs at copy speed on CPU (a 5-d fancy index was ~2x slower). Kept as [S, KVH, L, D]
        # so the batch dims (S, KVH) lead in both matmuls.
        x = kv_cache[layer, which].reshape(num_kv_heads, num_blocks, block_size * head_dim)
        x = jnp.take(x, block_tables.reshape(-1), axis=1, mode="clip")
        x = x.reshape(num_kv_heads, num_seqs, max_blocks * block_size, head_dim)
        return x.transpose(1, 0, 2, 3).astype(jnp.float32)

    k = gather(0)
    v = gather(1)
    num_keys = max_blocks * block_size

    # Ragged queries -> [S, qmax, KVH, G, D]; rows past a sequence's q_len are clipped reads
    # whose results are never gathered back.
    rows = qsl[:-1, None] + jnp.arange(qmax)[None, :]
    qg = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)
    qg = qg.reshape(num_seqs, qmax, num_kv_heads, group, head_dim)

    chunk = qmax
    while chunk > 1 and num_seqs * num_heads * chunk * num_keys > _REF_LOGITS_BUDGET:
        chunk = (chunk + 1) // 2
    num_chunks = -(-qmax // chunk)
    if num_chunks == 1:
        out = _reference_chunk(qg, k, v, seq_lens, q_lens, 0, scale)
    else:
        pad = num_chunks * chunk - qmax
        qg = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        qg = qg.reshape(num_seqs, num_chunks, chunk, num_kv_heads, group, head_dim)

        def body(args):
            qc, off = args
            return _reference_chunk(qc, k, v, seq_lens, q_lens, off, scale)

        out = jax.lax.map(body, (qg.transpose(1, 0, 2, 3, 4, 5),
                                 jnp.arange(num_chunks, dtype=jnp.int32) * chunk))
        out = out.transpose(1, 0, 2, 3, 4, 5).reshape(num_seqs, num_chunks * chunk, num_heads,
                                                      head_dim)[:, :qmax]
    out = out.reshape(num_seqs, qmax, num_heads, head_dim)

    # Back to token order: token t belongs to the last sequence whose start is <= t (padding
    # sequences with q_len 0 share their start with the next real one, so "last" skips them).
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, num_seqs - 1)
    idx = t - qsl[seq_of]
    valid = (t < qsl[-1]) & (idx < qmax)
    res = out[seq_of, jnp.clip(idx, 0, qmax - 1)]
    return jnp.where(valid[:, None, None], res, 0.0).astype(q.dtype)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _paged_attention_kernel(bt_ref, seq_lens_ref, qsl_ref, q_ref, k_ref, v_ref, o_ref, *,
                            scale: float, group: int, group_pad: int, block_q: int,
                            block_k: int):
    s = pl.program_id(0)
    tile = pl.program_id(1)
    h = pl.program_id(2)
    num_tokens, num_heads, head_dim = q_ref.shape
    num_blocks, block_size, _ = k_ref.shape
    max_blocks = bt_ref.shape[1]
    rows_per_tile = block_q * group_pad

    q_start = qsl_ref[s]
    q_len = qsl_ref[s + 1] - q_start
    seq_len = seq_lens_ref[s]
    tile_start = tile * block_q

    @pl.when(tile_start < q_len)
    def _():
        r = jnp.arange(rows_per_tile)
        i = tile_start + r // group_pad  # query index within the sequence
        g = r % group_pad
        row_ok = (i < q_len) & (g < group)
        tok = q_start + i
        head = h * group + g
        d = jnp.arange(head_dim)
        # Masked-off rows point out of bounds: masked lanes never touch memory on GPU, and in
        # interpret mode an out-of-bounds scatter index is dropped instead of aliasing a valid row.
        tok_idx = jnp.where(row_ok, tok, num_tokens)[:, None]
        head_idx = jnp.where(row_ok, head, num_heads)[:, None]
        q = plgpu.load(q_ref.at[tok_idx, head_idx, d[None, :]], mask=row_ok[:, None],
                       other=0.0)

        ctx_len = seq_len - q_len
        q_pos = ctx_len + i  # absolute position of each row
        # Causal: the tile's last real query needs keys up to its own position only.
        kv_end = jnp.minimum(seq_len, ctx_len + jnp.minimum(q_len, tile_start + block_q))

        def body(kb, carry):
            acc, m_prev, l_prev = carry
            key = kb * block_k + jnp.arange(block_k)
            key_ok = key < kv_end
            col = jnp.minimum(key // block_size, max_blocks - 1)
            blk = plgpu.load(bt_ref.at[s, col], mask=key_ok, other=0)
            off = key % block_size
            kv_idx = (blk[:, None], off[:, None], d[None, :])
            k = plgpu.load(k_ref.at[kv_idx], mask=key_ok[:, None], other=0.0)
            v = plgpu.load(v_ref.at[kv_idx], mask=key_ok[:, None], other=0.0)

            logits = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
            mask = (key[None, :] <= q_pos[:, None]) & key_ok[None, :]
            logits = jnp.where(mask, logits, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, logits.max(axis=1))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(logits - m_next[:, None])
            l_next = l_prev * correction + p.sum(axis=1)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
            return acc * correction[:, None] + pv, m_next, l_next

        acc = jnp.zeros((rows_per_tile, head_dim), jnp.float32)
        m_i = jnp.full((rows_per_tile,), _MASK_VALUE, jnp.float32)
        l_i = jnp.zeros((rows_per_tile,), jnp.float32)
        acc, m_i, l_i = lax.fori_loop(0, pl.cdiv(kv_end, block_k), body, (acc, m_i, l_i))
        # Every real row sees key 0, so l > 0 there; the guard only keeps masked rows finite.
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[tok_idx, head_idx, d[None, :]], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])


def _tile_sizes(group_pad: int, max_query_len: int, head_dim: int) -> tuple[int, int]:
    """Query tokens per tile (BQ) and keys per step (KB), all powers of two."""
    # M = BQ * Gp rows; 16 is Triton's smallest dot tile, 64-128 the usual flash tile.
    max_rows = 128 if head_dim <= 64 else 64
    block_q = min(_next_pow2(max_query_len), max(1, max_rows // group_pad))
    block_q = max(block_q, max(1, 16 // group_pad))
    block_k = 64
    return block_q, block_k


def _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens, query_start_loc, *,
                            scale, max_query_len, interpret):
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group)
    qmax = num_tokens if max_query_len is None else max(1, min(int(max_query_len), num_tokens))
    block_q, block_k = _tile_sizes(group_pad, qmax, head_dim)
    num_warps = 4 if block_q * group_pad <= 64 else 8

    kernel = functools.partial(_paged_attention_kernel, scale=float(scale), group=group,
                               group_pad=group_pad, block_q=block_q, block_k=block_k)
    grid = (num_seqs, pl.cdiv(qmax, block_q), num_kv_heads)

    def whole(shape):
        return pl.BlockSpec(shape, lambda s, j, h: (0,) * len(shape))

    def cache_spec(which):
        # The kernel sees one layer's K (or V) of one KV head: [num_blocks, block_size, head_dim].
        return pl.BlockSpec((None, None, None, num_blocks, block_size, head_dim),
                            lambda s, j, h: (layer, which, h, 0, 0, 0))

    qsl = query_start_loc.astype(jnp.int32)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(block_tables.shape), whole(seq_lens.shape), whole(qsl.shape),
                  whole(q.shape), cache_spec(0), cache_spec(1)],
        out_specs=whole(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="paged_attention",
    )(block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), qsl, q, kv_cache, kv_cache)
    valid = jnp.arange(num_tokens) < qsl[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                    max_query_len: int | None = None, backend: str = "reference") -> jax.Array:
    """Causal attention of a ragged batch of queries against the paged KV cache.

    q: [T, num_heads, head_dim]; rows at index >= query_start_loc[-1] are padding.
    kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]; ``layer`` static.
    block_tables: [S, max_blocks_per_seq] int32 physical block ids (unused entries ignored).
    seq_lens: [S] int32 context length including this step's tokens (already written).
    query_start_loc: [S+1] int32 cumulative query lengths.
    Query i of sequence s sits at position seq_lens[s] - q_len_s + i and sees keys 0..position.
    max_query_len: static bound on any q_len (None -> T).
    Returns [T, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    if backend == "reference":
        return paged_attention_reference(q, kv_cache, layer, block_tables, seq_lens,
                                         query_start_loc, scale=scale,
                                         max_query_len=max_query_len)
    if backend in ("pallas", "interpret"):
        return _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens,
                                       query_start_loc, scale=scale, max_query_len=max_query_len,
                                       interpret=backend == "interpret")
    raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")


def lowering_cases(model, dtype, phase: str) -> list[tuple[str, Callable, tuple]]:
    """Shapes for lowering ``paged_attention`` (backend="pallas") to CUDA without a GPU.

    decode: 64 sequences x 1 token, contexts up to 4096 (256 blocks of 16), max_query_len 1.
    prefill: 2048 tokens over 4 sequences, blocks of 16 and of 32, max_query_len 2048.
    The cache spans all layers (64 x 4096 tokens), > 4 GiB for the larger models, so the
    64-bit addressing path of the Triton lowering is exercised too.
    """
    if phase == "decode":
        shapes = [(64, 64, 1, 16)]  # tokens, sequences, max_query_len, block_size
    elif phase == "prefill":
        shapes = [(2048, 4, 2048, 16), (2048, 4, 2048, 32)]
    else:
        raise ValueError(f"unknown phase {phase!r}")
    num_layers = getattr(model, "num_layers", None) or getattr(model, "num_hidden_layers", 24)
    cases = []
    for num_tokens, num_seqs, max_query_len, block_size in shapes:
        max_blocks = 4096 // block_size
        cache = (num_layers, 2, model.num_kv_heads, 64 * max_blocks, block_size, model.head_dim)

        def fn(q, kv_cache, block_tables, seq_lens, query_start_loc, _mq=max_query_len):
            return paged_attention(q, kv_cache, num_layers - 1, block_tables, seq_lens,
                                   query_start_loc, scale=model.head_dim ** -0.5,
                                   max_query_len=_mq, backend="pallas")

        args = (jax.ShapeDtypeStruct((num_tokens, model.num_heads, model.head_dim), dtype),
                jax.ShapeDtypeStruct(cache, dtype),
                jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
                jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
                jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
        cases.append((f"paged_attention_bs{block_size}", fn, args))
    return cases
