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
* Tile sizes (``_launch_config``): for bfloat16, M = BQ x Gp is 128 rows (head_dim 64) or 64
  (head_dim 128) for prefill and KB = 64 keys per step; float32 takes M = 32 and KB = 32 (its
  FMA dots hold whole operand rows in registers). A pure decode step (max_query_len 1) has
  BQ = max(1, 16 // Gp), i.e. M = 16, Triton's smallest dot tile. Every tl.dot is thus >= 16
  in M, N and K.
* Precision: bf16 inputs go to the tensor cores as bf16 with float32 accumulation (p is
  rounded to bf16 before P @ V, as in any flash kernel); float32 inputs use IEEE float32 dots
  (Precision.HIGHEST, not TF32) so that they match the reference to ~1e-5.
* Addressing: offsets are 32-bit unless the cache array exceeds 4 GiB, in which case the
  Pallas Triton lowering switches to 64-bit offsets on its own (checked in the lowering cases,
  whose all-layer caches for the larger models are > 4 GiB).
* Rows of padding tokens (>= query_start_loc[-1]) belong to no program; the wrapper zeroes them
  after the call (one cheap select) rather than launching programs just to write zeros.

Split-K decode (``num_splits`` > 1, flash-decoding) lives in split_k_decode.py; the public
``paged_attention`` below dispatches to it.

Reference design (XLA, what the engine runs on CPU at every layer of every step). Its cost
follows the real work, never the padded bucket shapes: loop trip counts are computed at run
time from the real lengths, so padding tokens, padding sequences, the block table width and
``max_query_len`` cost nothing, and each query visits only the key tiles (128 keys, whole
blocks) up to its own position. Decode-like tokens (q_len < 4) each gather their own key
tiles, in groups of 16 tokens sorted by context length; prefill chunks are cut into query
tiles of 32 tokens that share each gathered key tile (real matmuls). Both run an online
softmax in float32 and gather K/V blocks straight from the all-layer cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import check_backend, next_pow2, whole_block_spec

# Finite stand-in for -inf: masked logits must never produce inf - inf = nan.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Reference (XLA) path tuning, read at trace time (tests shrink them to force many iterations).
# Keys per inner loop step, rounded up to whole blocks: the causal/ragged granularity.
_REF_KEY_TILE = 128
# Token pass: tokens per group; each token of a group gathers its own key tile, so a step
# gathers group x key tile x 1 KiB (0.5B shapes: 2 MiB, L2-resident).
_REF_TOKEN_GROUP = 16
# Tile pass: sequences with at least _REF_TILE_MIN_QUERIES queries this step are cut into query
# tiles of _REF_QUERY_TILE tokens that share each gathered key tile (real matmuls, several times
# the rate of the G-row matmuls of the token pass: docs/perf/cpu-step.md).
_REF_QUERY_TILE = 32
_REF_TILE_MIN_QUERIES = 4


def _count_le(sorted_values, x):
    """searchsorted(sorted_values, x, side="right") by comparing against every entry: the
    arrays here are small (tokens, sequences) and this compiles to one fusion, not a loop."""
    return jnp.sum(sorted_values <= x[..., None], axis=-1, dtype=jnp.int32)


def _gather_kv(cache_rows, first_row, which, blk):
    """K (which=0) or V (1) of blocks ``blk`` (any shape) of every KV head, as
    [KVH, *blk.shape, block_size, head_dim] f32. cache_rows: [rows, block_size, head_dim], the
    all-layer cache with one row per (layer, K/V, head, block); first_row(which) gives the static
    row of block 0 of each head, [KVH] ints. Every index is in bounds by construction (block ids
    are clipped), so a bare gather without clamping or negative-index fix-ups is emitted: jnp
    indexing adds both per element, and gathered slower with them (docs/perf/cpu-step.md)."""
    rows = jnp.asarray(first_row(which), jnp.int32).reshape((-1,) + (1,) * blk.ndim) + blk
    dnums = lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    out = lax.gather(cache_rows, rows.reshape(-1, 1), dnums, (1,) + cache_rows.shape[1:],
                     mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return out.reshape(rows.shape + cache_rows.shape[1:]).astype(jnp.float32)


def _flash_update(carry, logits, mask, v, pv_spec):
    """One online-softmax step over a key tile; keys are the last axis of ``logits``/``mask``.
    Masked logits get a finite value, so nothing computes inf - inf. Every real query sees key
    0 in the first tile, so from then on its running max is a real logit and a masked logit
    contributes exp(_MASK_VALUE - max) == 0 exactly; rows with no visible key at all end up
    finite but meaningless, and the callers discard them."""
    m_run, l_run, acc_run = carry
    logits = jnp.where(mask, logits, _MASK_VALUE)
    m_new = jnp.maximum(m_run, logits.max(axis=-1))
    alpha = jnp.exp(m_run - m_new)
    p = jnp.exp(logits - m_new[..., None])
    l_new = l_run * alpha + p.sum(axis=-1)
    acc_new = acc_run * alpha[..., None] + jnp.einsum(pv_spec, p, v)
    return m_new, l_new, acc_new


def _init_state(shape, head_dim):
    return (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _token_pass(q, cache_rows, first_row, block_tables, seq_of, pos, tiles, *, scale, nb,
                num_blocks):
    """Attention of every token t with tiles[t] > 0 against its own keys 0..pos[t] (tiles[t]
    key tiles of nb blocks). Tokens are sorted by tile count (descending) and taken in groups
    of TC: the outer loop runs over the groups that have work, the inner loop over the key
    tiles of the group's longest token, so the work is about sum(tiles) x key tile whatever
    the padding. q: [T, KVH, G, D]. Returns [T, KVH, G, D] f32, zeros where tiles == 0."""
    num_tokens, num_kv_heads, group, head_dim = q.shape
    max_blocks = block_tables.shape[1]
    key_tile = nb * cache_rows.shape[1]
    tc = min(_REF_TOKEN_GROUP, num_tokens)
    order = jnp.argsort(-tiles, stable=True).astype(jnp.int32)
    # Per sorted slot: token, tiles (descending), sequence, position; one row per slot.
    meta = jnp.stack([order, tiles[order], seq_of[order], pos[order]])
    num_groups = -(-jnp.sum(tiles > 0, dtype=jnp.int32) // tc)

    def group_body(carry):
        c, out = carry
        start = jnp.minimum(c * tc, num_tokens - tc)  # the last group may overlap the previous
        tok, n_tiles, seq, q_pos = lax.dynamic_slice_in_dim(meta, start, tc, axis=1)
        q_g = (q[tok].astype(jnp.float32) * scale).transpose(1, 0, 2, 3)  # [KVH, TC, G, D]

        def key_body(j, state):
            col = jnp.minimum(j * nb + jnp.arange(nb, dtype=jnp.int32), max_blocks - 1)
            blk = jnp.clip(block_tables[seq[:, None], col[None, :]], 0, num_blocks - 1)
            k = _gather_kv(cache_rows, first_row, 0, blk).reshape(num_kv_heads, tc, key_tile,
                                                                  head_dim)
            v = _gather_kv(cache_rows, first_row, 1, blk).reshape(k.shape)
            key = j * key_tile + jnp.arange(key_tile, dtype=jnp.int32)
            mask = (key[None, :] <= q_pos[:, None]) & (j < n_tiles)[:, None]  # [TC, KT]
            # (Logits as [KVH, TC, KT, G] made the QK matmul alone faster but the whole step
            # slower: exp and reductions over a minor axis of 7.)
            logits = jnp.einsum("kwgd,kwjd->kwgj", q_g, k)
            return _flash_update(state, logits, mask[None, :, None, :], v, "kwgj,kwjd->kwgd")

        _, l_run, acc_run = lax.fori_loop(0, n_tiles[0], key_body,
                                          _init_state((num_kv_heads, tc, group), head_dim))
        # l >= 1 wherever a tile ran (the max term is exp(0)); tokens without tiles: zeros.
        res = jnp.where((n_tiles > 0)[None, :, None, None], acc_run / l_run[..., None], 0.0)
        return c + 1, out.at[tok].set(res.transpose(1, 0, 2, 3), unique_indices=True)

    out = jnp.zeros(q.shape, jnp.float32)
    return lax.while_loop(lambda c: c[0] < num_groups, group_body, (jnp.int32(0), out))[1]


def _tile_pass(out, q, cache_rows, first_row, block_tables, seq_lens, qsl, tiled_seq, *,
               scale, nb, num_blocks):
    """Attention of the tokens of sequences with tiled_seq[s]: query tiles of BQ consecutive
    tokens of one sequence share each gathered key tile; an outer loop walks the tiles, an
    inner loop the key tiles up to the tile's last query. Writes those rows of ``out``
    ([T, KVH, G, D] f32) and returns it; other rows are kept."""
    num_tokens, num_kv_heads, group, head_dim = q.shape
    max_blocks = block_tables.shape[1]
    key_tile = nb * cache_rows.shape[1]
    bq = min(_REF_QUERY_TILE, num_tokens)
    num_seqs = seq_lens.shape[0]
    q_lens = qsl[1:] - qsl[:-1]
    seq_tiles = jnp.where(tiled_seq, -(-q_lens // bq), 0)
    tiles_end = jnp.cumsum(seq_tiles)
    # Every tile's metadata up front, vectorized over a static bound on the tile count (tiled
    # sequences have >= _REF_TILE_MIN_QUERIES tokens each), so the loop body only indexes it.
    tile = jnp.arange(-(-num_tokens // bq) + min(num_seqs, num_tokens // _REF_TILE_MIN_QUERIES),
                      dtype=jnp.int32)
    seq = jnp.minimum(_count_le(tiles_end, tile), num_seqs - 1)  # the tile's sequence
    start = qsl[seq] + (tile - (tiles_end[seq] - seq_tiles[seq])) * bq  # its first token
    n_rows = jnp.minimum(bq, qsl[seq + 1] - start)  # real tokens in the tile
    # The tile is read and written through a window of BQ rows that fits in [0, T): it starts
    # ``off`` rows before the tile when the tile is near the end.
    win = jnp.minimum(start, num_tokens - bq)
    off = start - win
    pos0 = seq_lens[seq] - (qsl[seq + 1] - win)  # position of the window's first token
    key_tiles = -(-(pos0 + off + n_rows) // key_tile)  # keys 0 .. the last token's position
    meta = jnp.stack([seq, win, off, n_rows, pos0, key_tiles])

    def tile_body(carry):
        k, out = carry
        s, win, off, n_rows, pos0, key_tiles = lax.dynamic_slice_in_dim(meta, k, 1, axis=1)[:, 0]
        row_tok = jnp.arange(bq * group, dtype=jnp.int32) // group  # row r: token r // G
        q_pos = pos0 + row_tok
        row_ok = (row_tok >= off) & (row_tok < off + n_rows)
        q_t = lax.dynamic_slice_in_dim(q, win, bq).astype(jnp.float32) * scale
        q_t = q_t.transpose(1, 0, 2, 3).reshape(num_kv_heads, bq * group, head_dim)

        def key_body(j, state):
            col = jnp.minimum(j * nb + jnp.arange(nb, dtype=jnp.int32), max_blocks - 1)
            blk = jnp.clip(block_tables[s, col], 0, num_blocks - 1)  # past the end: masked
            k_t = _gather_kv(cache_rows, first_row, 0, blk).reshape(num_kv_heads, key_tile,
                                                                    head_dim)
            v_t = _gather_kv(cache_rows, first_row, 1, blk).reshape(k_t.shape)
            key = j * key_tile + jnp.arange(key_tile, dtype=jnp.int32)
            mask = (key[None, :] <= q_pos[:, None]) & row_ok[:, None]  # [BQ * G, KT]
            logits = jnp.einsum("kmd,kjd->kmj", q_t, k_t)
            return _flash_update(state, logits, mask[None], v_t, "kmj,kjd->kmd")

        _, l_run, acc_run = lax.fori_loop(0, key_tiles, key_body,
                                          _init_state((num_kv_heads, bq * group), head_dim))
        res = (acc_run / l_run[..., None]).reshape(num_kv_heads, bq, group, head_dim)
        # Window rows outside the tile belong to other tokens: keep what is there.
        old = lax.dynamic_slice_in_dim(out, win, bq)
        res = jnp.where(row_ok[::group, None, None, None], res.transpose(1, 0, 2, 3), old)
        return k + 1, lax.dynamic_update_slice_in_dim(out, res, win, 0)

    return lax.while_loop(lambda c: c[0] < tiles_end[-1], tile_body, (jnp.int32(0), out))[1]


def paged_attention_reference(q: jax.Array, kv_cache: jax.Array, layer: int,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              query_start_loc: jax.Array, *, scale: float,
                              max_query_len: int | None = None) -> jax.Array:
    """XLA version of ``paged_attention`` whose cost follows the real work, not the padding.

    Flash attention (online softmax, float32 throughout) in loops whose trip counts are
    computed at run time from the real lengths: padding tokens, padding sequences and the
    block table width cost nothing, and each query visits only the key tiles up to its own
    position. K/V are gathered by whole blocks straight from the all-layer cache (never a copy
    of a layer slice). Two passes, by the number of queries a sequence has this step:

    * fewer than _REF_TILE_MIN_QUERIES (decode): ``_token_pass``, each token against its own
      keys, tokens grouped by similar context length;
    * more (prefill chunks): ``_tile_pass``, query tiles of one sequence sharing each gathered
      key tile, so the matmuls have BQ x G rows.

    ``max_query_len`` (static) only prunes: below _REF_TILE_MIN_QUERIES (a pure decode step)
    the tile pass is not even compiled and every token takes the token pass.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    num_seqs, max_blocks = block_tables.shape
    qmax = num_tokens if max_query_len is None else min(int(max_query_len), num_tokens)
    nb = max(1, min(-(-_REF_KEY_TILE // block_size), max_blocks))  # blocks per key tile
    use_tiles = qmax >= _REF_TILE_MIN_QUERIES  # static

    seq_lens = seq_lens.astype(jnp.int32)
    qsl = query_start_loc.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)  # ids are clipped where gathered
    # Without the tile pass every token takes the token pass, so a max_query_len that is too
    # small costs speed, never correctness.
    tiled_seq = ((qsl[1:] - qsl[:-1]) >= _REF_TILE_MIN_QUERIES) & use_tiles

    # Per token: its sequence (the last one starting at or before it, so zero-length padding
    # sequences sharing that start are skipped) and absolute position.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of = jnp.clip(_count_le(qsl, t) - 1, 0, num_seqs - 1)
    pos = seq_lens[seq_of] - (qsl[seq_of + 1] - t)  # seq_len - q_len + index in the sequence
    kv_end = jnp.clip(pos + 1, 0, max_blocks * block_size)
    token_tiles = jnp.where((t < qsl[-1]) & ~tiled_seq[seq_of],
                            -(-kv_end // (nb * block_size)), 0)  # padding tokens: none

    # q as [T, KVH, G, D]; the cache as rows of one block of one head (free reshapes): row
    # ((layer * 2 + kv) * KVH + head) * num_blocks + block.
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    cache_rows = kv_cache.reshape(num_layers * 2 * num_kv_heads * num_blocks, block_size,
                                  head_dim)

    def first_row(which):
        return [((layer * 2 + which) * num_kv_heads + h) * num_blocks
                for h in range(num_kv_heads)]

    kw = dict(scale=scale, nb=nb, num_blocks=num_blocks)
    out = _token_pass(q4, cache_rows, first_row, block_tables, seq_of, pos, token_tiles, **kw)
    if use_tiles:
        out = _tile_pass(out, q4, cache_rows, first_row, block_tables, seq_lens, qsl, tiled_seq,
                         **kw)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _key_step(bt_ref, k_ref, v_ref, s, q, q_pos, kv_end, kb, carry, *, scale: float,
              block_k: int):
    """One online-softmax step of the Triton kernels over key tile ``kb`` (keys kb * KB ..
    kb * KB + KB - 1) of sequence ``s``: gathers K/V through the block table (keys at or past
    ``kv_end`` load as zeros), masks keys past each row's position ``q_pos``. carry: (acc [M, D],
    running max [M], running sum [M]), float32."""
    acc, m_prev, l_prev = carry
    block_size, head_dim = k_ref.shape[1], k_ref.shape[2]
    max_blocks = bt_ref.shape[1]
    d = jnp.arange(head_dim)
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


def _kernel_init_state(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _paged_attention_kernel(bt_ref, seq_lens_ref, qsl_ref, q_ref, k_ref, v_ref, o_ref, *,
                            scale: float, group: int, group_pad: int, block_q: int,
                            block_k: int):
    s = pl.program_id(0)
    tile = pl.program_id(1)
    h = pl.program_id(2)
    num_tokens, num_heads, head_dim = q_ref.shape
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

        body = functools.partial(_key_step, bt_ref, k_ref, v_ref, s, q, q_pos, kv_end,
                                 scale=scale, block_k=block_k)
        acc, m_i, l_i = lax.fori_loop(0, pl.cdiv(kv_end, block_k), body,
                                      _kernel_init_state(rows_per_tile, head_dim))
        # Every real row sees key 0, so l > 0 there; the guard only keeps masked rows finite.
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[tok_idx, head_idx, d[None, :]], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])


def _launch_config(group_pad: int, max_query_len: int, head_dim: int,
                   dtype) -> tuple[int, int, int, int]:
    """Query tokens per tile (BQ), keys per step (KB), num_warps and num_stages.

    M = BQ * Gp rows; 16 is Triton's smallest dot tile. bfloat16 runs on the tensor cores with
    the usual flash tiles: M = 128 (head_dim 64) or 64 (head_dim 128), KB = 64.

    float32 (IEEE, no TF32) runs its dots on the FMA units, where Triton keeps each thread's
    rows of both operands in registers over the whole reduction axis: registers grow with M x
    head_dim (QK^T) and M x KB (P @ V), not just with the accumulator. The bfloat16 tiles then
    need 255+ registers and spill (sm_90a). Tiles of M = 32 (decode: 16) and KB = 32 over 8
    warps compile with no spills and no stack (docs/perf/gpu-kernel-model.md).
    """
    if jnp.dtype(dtype) == jnp.float32:
        max_rows, block_k, num_warps = 32, 32, 8
    else:
        max_rows, block_k = (128 if head_dim <= 64 else 64), 64
        num_warps = None
    block_q = min(next_pow2(max_query_len), max(1, max_rows // group_pad))
    block_q = max(block_q, max(1, 16 // group_pad))
    if num_warps is None:
        num_warps = 4 if block_q * group_pad <= 64 else 8
    return block_q, block_k, num_warps, 2


def _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens, query_start_loc, *,
                            scale, max_query_len, interpret):
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    qmax = num_tokens if max_query_len is None else max(1, min(int(max_query_len), num_tokens))
    block_q, block_k, num_warps, num_stages = _launch_config(group_pad, qmax, head_dim,
                                                             q.dtype)

    kernel = functools.partial(_paged_attention_kernel, scale=float(scale), group=group,
                               group_pad=group_pad, block_q=block_q, block_k=block_k)
    grid = (num_seqs, pl.cdiv(qmax, block_q), num_kv_heads)

    def cache_spec(which):
        # The kernel sees one layer's K (or V) of one KV head: [num_blocks, block_size, head_dim].
        return pl.BlockSpec((None, None, None, num_blocks, block_size, head_dim),
                            lambda s, j, h: (layer, which, h, 0, 0, 0))

    qsl = query_start_loc.astype(jnp.int32)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole_block_spec(block_tables.shape), whole_block_spec(seq_lens.shape),
                  whole_block_spec(qsl.shape), whole_block_spec(q.shape), cache_spec(0),
                  cache_spec(1)],
        out_specs=whole_block_spec(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention",
    )(block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), qsl, q, kv_cache, kv_cache)
    valid = jnp.arange(num_tokens) < qsl[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int, block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                    max_query_len: int | None = None, backend: str = "reference",
                    num_splits: int = 1) -> jax.Array:
    """Causal attention of a ragged batch of queries against the paged KV cache.

    q: [T, num_heads, head_dim]; rows at index >= query_start_loc[-1] are padding.
    kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]; ``layer`` static.
    block_tables: [S, max_blocks_per_seq] int32 physical block ids (unused entries ignored).
    seq_lens: [S] int32 context length including this step's tokens (already written).
    query_start_loc: [S+1] int32 cumulative query lengths.
    Query i of sequence s sits at position seq_lens[s] - q_len_s + i and sees keys 0..position.
    max_query_len: static bound on any q_len (None -> T).
    num_splits: static power of two; > 1 selects split-K decode (flash-decoding: each context
    is cut into num_splits parts that run in parallel, then merged exactly), which needs
    max_query_len == 1; ``split_k_decode.decode_num_splits`` sizes it. The reference backend
    computes the same attention unsplit.
    Returns [T, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    check_backend(backend)
    num_splits = int(num_splits)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if num_splits > 1 and max_query_len != 1:
        raise ValueError(f"num_splits > 1 is for decode steps (max_query_len 1), got "
                         f"max_query_len={max_query_len}")
    if backend == "reference":
        return paged_attention_reference(q, kv_cache, layer, block_tables, seq_lens,
                                         query_start_loc, scale=scale,
                                         max_query_len=max_query_len)
    if num_splits > 1:
        # Imported here: split_k_decode builds on this module's kernel pieces.
        from pallas_kernels.split_k_decode import _paged_attention_decode_split_pallas

        return _paged_attention_decode_split_pallas(
            q, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale=scale,
            num_splits=num_splits, interpret=backend == "interpret")
    return _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens, query_start_loc,
                                   scale=scale, max_query_len=max_query_len,
                                   interpret=backend == "interpret")


def lowering_cases(model, dtype, phase: str) -> list[tuple[str, Callable, tuple]]:
    """Shapes for lowering ``paged_attention`` (backend="pallas") to CUDA without a GPU.

    decode: 64 sequences x 1 token, contexts up to 4096 (256 blocks of 16), max_query_len 1;
    and split-K decode of 8 sequences (a small batch) with ``decode_num_splits`` for a
    max_model_len of 4096 (16 splits for 2 KV heads, 8 for 4): two kernels, split and combine.
    prefill: 2048 tokens over 4 sequences, blocks of 16 and of 32, max_query_len 2048.
    The cache spans all layers (64 x 4096 tokens), > 4 GiB for the larger models, so the
    64-bit addressing path of the Triton lowering is exercised too.
    """
    from pallas_kernels.split_k_decode import decode_num_splits

    max_model_len = 4096
    if phase == "decode":
        # tokens, sequences, max_query_len, block_size, num_splits
        shapes = [(64, 64, 1, 16, 1),
                  (8, 8, 1, 16, decode_num_splits(max_model_len, 8, model.num_kv_heads))]
    elif phase == "prefill":
        shapes = [(2048, 4, 2048, 16, 1), (2048, 4, 2048, 32, 1)]
    else:
        raise ValueError(f"unknown phase {phase!r}")
    num_layers = getattr(model, "num_layers", None) or getattr(model, "num_hidden_layers", 24)
    cases = []
    for num_tokens, num_seqs, max_query_len, block_size, num_splits in shapes:
        max_blocks = max_model_len // block_size
        cache = (num_layers, 2, model.num_kv_heads, 64 * max_blocks, block_size, model.head_dim)

        def fn(q, kv_cache, block_tables, seq_lens, query_start_loc, _mq=max_query_len,
               _ns=num_splits):
            return paged_attention(q, kv_cache, num_layers - 1, block_tables, seq_lens,
                                   query_start_loc, scale=model.head_dim ** -0.5,
                                   max_query_len=_mq, backend="pallas", num_splits=_ns)

        args = (jax.ShapeDtypeStruct((num_tokens, model.num_heads, model.head_dim), dtype),
                jax.ShapeDtypeStruct(cache, dtype),
                jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
                jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
                jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
        name = "paged_attention_splitk" if num_splits > 1 else "paged_attention"
        cases.append((f"{name}_bs{block_size}", fn, args))
    return cases
