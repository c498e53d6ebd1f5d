"""Paged attention in plain XLA ops: ``paged_attention(..., backend="reference")``, what the
engine runs on CPU at every layer of every step, and the oracle the Pallas kernels are tested
against. Inputs and outputs are those of ``paged_attention`` (layout in paged_attention.py).

Its cost follows the real work, never the padded bucket shapes: loop trip counts are computed
at run time from the real lengths, so padding tokens, padding sequences, the block table width
and ``max_query_len`` cost nothing, and each query visits only the key tiles (128 keys, whole
blocks) up to its own position. Decode-like tokens (q_len < 4) each gather their own key
tiles, in groups of 16 tokens sorted by context length; prefill chunks are cut into query
tiles of 32 tokens that share each gathered key tile (real matmuls). Both run an online
softmax in float32 and gather K/V blocks straight from the all-layer cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention_common import MASK_VALUE, soft_cap
from pallas_kernels.common import check_layer

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
    contributes exp(MASK_VALUE - max) == 0 exactly; rows with no visible key at all end up
    finite but meaningless, and the callers discard them. With a sliding window a row may see
    no key of its first tiles: its running max stays MASK_VALUE until its first visible key,
    whose rescaling exp(MASK_VALUE - logit) == 0 wipes what those tiles added."""
    m_run, l_run, acc_run = carry
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_new = jnp.maximum(m_run, logits.max(axis=-1))
    alpha = jnp.exp(m_run - m_new)
    p = jnp.exp(logits - m_new[..., None])
    l_new = l_run * alpha + p.sum(axis=-1)
    acc_new = acc_run * alpha[..., None] + jnp.einsum(pv_spec, p, v)
    return m_new, l_new, acc_new


def _init_state(shape, head_dim):
    return (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))


def _token_pass(q, cache_rows, first_row, block_tables, seq_of, pos, tiles, *, scale, nb,
                num_blocks, window, cap, first_tile):
    """Attention of every token t with tiles[t] > 0 against its own keys 0..pos[t] (tiles[t]
    key tiles of nb blocks; with a sliding ``window``, keys pos[t] - window + 1..pos[t], tiles
    from first_tile[t] on). Tokens are sorted by tile count (descending) and taken in groups
    of TC: the outer loop runs over the groups that have work, the inner loop over the key
    tiles of the group's longest token, so the work is about sum(tiles) x key tile whatever
    the padding. q: [T, KVH, G, D]. Returns [T, KVH, G, D] f32, zeros where tiles == 0."""
    num_tokens, num_kv_heads, group, head_dim = q.shape
    max_blocks = block_tables.shape[1]
    key_tile = nb * cache_rows.shape[1]
    tc = min(_REF_TOKEN_GROUP, num_tokens)
    order = jnp.argsort(-tiles, stable=True).astype(jnp.int32)
    # Per sorted slot: token, tiles (descending), sequence, position; one row per slot.
    rows = [order, tiles[order], seq_of[order], pos[order]]
    if window is not None:
        rows.append(first_tile[order])
    meta = jnp.stack(rows)
    num_groups = -(-jnp.sum(tiles > 0, dtype=jnp.int32) // tc)

    def group_body(carry):
        c, out = carry
        start = jnp.minimum(c * tc, num_tokens - tc)  # the last group may overlap the previous
        tok, n_tiles, seq, q_pos, *first = lax.dynamic_slice_in_dim(meta, start, tc, axis=1)
        q_g = (q[tok].astype(jnp.float32) * scale).transpose(1, 0, 2, 3)  # [KVH, TC, G, D]

        def key_body(j, state):
            if window is None:
                col = jnp.minimum(j * nb + jnp.arange(nb, dtype=jnp.int32), max_blocks - 1)
                col = col[None, :]
                key = (j * key_tile + jnp.arange(key_tile, dtype=jnp.int32))[None, :]
            else:  # each token's j-th tile of its window
                jt = (first[0] + j)[:, None]
                col = jnp.minimum(jt * nb + jnp.arange(nb, dtype=jnp.int32), max_blocks - 1)
                key = jt * key_tile + jnp.arange(key_tile, dtype=jnp.int32)
            blk = jnp.clip(block_tables[seq[:, None], col], 0, num_blocks - 1)
            k = _gather_kv(cache_rows, first_row, 0, blk).reshape(num_kv_heads, tc, key_tile,
                                                                  head_dim)
            v = _gather_kv(cache_rows, first_row, 1, blk).reshape(k.shape)
            mask = (key <= q_pos[:, None]) & (j < n_tiles)[:, None]  # [TC, KT]
            if window is not None:
                mask = mask & (key > q_pos[:, None] - window)
            # (Logits as [KVH, TC, KT, G] made the QK matmul alone faster but the whole step
            # slower: exp and reductions over a minor axis of 7.)
            logits = soft_cap(jnp.einsum("kwgd,kwjd->kwgj", q_g, k), cap)
            return _flash_update(state, logits, mask[None, :, None, :], v, "kwgj,kwjd->kwgd")

        _, l_run, acc_run = lax.fori_loop(0, n_tiles[0], key_body,
                                          _init_state((num_kv_heads, tc, group), head_dim))
        # l >= 1 wherever a tile ran (the max term is exp(0)); tokens without tiles: zeros.
        res = jnp.where((n_tiles > 0)[None, :, None, None], acc_run / l_run[..., None], 0.0)
        return c + 1, out.at[tok].set(res.transpose(1, 0, 2, 3), unique_indices=True)

    out = jnp.zeros(q.shape, jnp.float32)
    return lax.while_loop(lambda c: c[0] < num_groups, group_body, (jnp.int32(0), out))[1]


def _tile_pass(out, q, cache_rows, first_row, block_tables, seq_lens, qsl, tiled_seq, *,
               scale, nb, num_blocks, window, cap, first_tile):
    """Attention of the tokens of sequences with tiled_seq[s]: query tiles of BQ consecutive
    tokens of one sequence share each gathered key tile; an outer loop walks the tiles, an
    inner loop the key tiles up to the tile's last query (with a sliding ``window``, from the
    one where the tile's first query's window starts). Writes those rows of ``out``
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
    rows = [seq, win, off, n_rows, pos0, key_tiles]
    if window is not None:
        rows.append(first_tile(pos0 + off))
    meta = jnp.stack(rows)

    def tile_body(carry):
        k, out = carry
        s, win, off, n_rows, pos0, key_tiles, *first = \
            lax.dynamic_slice_in_dim(meta, k, 1, axis=1)[:, 0]
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
            if window is not None:
                mask = mask & (key[None, :] > q_pos[:, None] - window)
            logits = soft_cap(jnp.einsum("kmd,kjd->kmj", q_t, k_t), cap)
            return _flash_update(state, logits, mask[None], v_t, "kmj,kjd->kmd")

        _, l_run, acc_run = lax.fori_loop(first[0] if first else 0, key_tiles, key_body,
                                          _init_state((num_kv_heads, bq * group), head_dim))
        res = (acc_run / l_run[..., None]).reshape(num_kv_heads, bq, group, head_dim)
        # Window rows outside the tile belong to other tokens: keep what is there.
        old = lax.dynamic_slice_in_dim(out, win, bq)
        res = jnp.where(row_ok[::group, None, None, None], res.transpose(1, 0, 2, 3), old)
        return k + 1, lax.dynamic_update_slice_in_dim(out, res, win, 0)

    return lax.while_loop(lambda c: c[0] < tiles_end[-1], tile_body, (jnp.int32(0), out))[1]


def paged_attention_reference(q: jax.Array, kv_cache: jax.Array, layer: int | jax.Array,
                              block_tables: jax.Array, seq_lens: jax.Array,
                              query_start_loc: jax.Array, *, scale: float,
                              max_query_len: int | None = None,
                              sliding_window: int | None = None,
                              logits_soft_cap: float | None = None) -> jax.Array:
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

    ``sliding_window`` (static): a query at p sees keys p - sliding_window + 1..p, and both
    passes start at the key tile where the window starts, so a query's cost is bounded by the
    window. None compiles exactly the unwindowed loops.

    ``logits_soft_cap`` (static): each scaled logit x becomes cap * tanh(x / cap) before the
    mask and softmax (Gemma 2); None: no cap, the same compiled loops.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    layer = check_layer(layer, num_layers)
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
    key_tile = nb * block_size

    def first_tile(first_pos):
        return None if sliding_window is None else \
            jnp.maximum(first_pos - sliding_window + 1, 0) // key_tile

    token_first = first_tile(pos)
    token_end = -(-kv_end // key_tile)
    if token_first is not None:
        token_end = token_end - token_first
    token_tiles = jnp.where((t < qsl[-1]) & ~tiled_seq[seq_of], token_end,
                            0)  # padding tokens: none

    # q as [T, KVH, G, D]; the cache as rows of one block of one head (free reshapes): row
    # ((layer * 2 + kv) * KVH + head) * num_blocks + block.
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    cache_rows = kv_cache.reshape(num_layers * 2 * num_kv_heads * num_blocks, block_size,
                                  head_dim)

    def first_row(which):
        return [((layer * 2 + which) * num_kv_heads + h) * num_blocks
                for h in range(num_kv_heads)]

    kw = dict(scale=scale, nb=nb, num_blocks=num_blocks, window=sliding_window,
              cap=logits_soft_cap)
    out = _token_pass(q4, cache_rows, first_row, block_tables, seq_of, pos, token_tiles, **kw,
                      first_tile=token_first)
    if use_tiles:
        out = _tile_pass(out, q4, cache_rows, first_row, block_tables, seq_lens, qsl, tiled_seq,
                         **kw, first_tile=first_tile)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
