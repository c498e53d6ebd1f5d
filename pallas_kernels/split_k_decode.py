"""Split-K decode for paged attention (flash-decoding): the Pallas kernels behind
``paged_attention(..., num_splits=N)`` (paged_attention.py holds the public wrapper,
attention_common.py the kernel pieces both kernels use and ``decode_num_splits``).

Split-K decode (flash-decoding, ``num_splits`` > 1, max_query_len 1). A decode step has only
S x num_kv_heads programs, too few to fill the GPU when the batch is small; split-K cuts each
context into ``num_splits`` parts that run in parallel and merges them exactly:

* Split kernel, grid ``(S, num_splits, num_kv_heads)``: program (s, p, h) takes the Gp query
  heads of KV head h (padded to M = 16 rows as in decode) over the key tiles of split p and
  runs the same online softmax. The cdiv(seq_len, KB) key tiles of a sequence are dealt out in
  runs of cdiv(tiles, num_splits) (``_decode_partition``), so any context length spreads over
  the splits; splits past a short context (and padding sequences) exit at once, writing
  nothing. With a sliding window only the tiles from the window's first one are dealt out, so
  the splits share the window's keys, not the whole context's. Each real head row writes its
  unnormalised float32 accumulator to
  acc [S, num_splits, num_heads, head_dim] and its running max and sum to two
  [S, num_splits, num_heads] float32 arrays (scratch outputs: head_dim x 4 + 8 bytes per
  sequence, split and head, small next to the K/V a split reads).
* Combine kernel, grid ``(S,)``: one program per sequence merges the splits of all its heads
  (rows padded to the next power of two) in a loop over the splits with the online-softmax
  rescaling, and writes the normalised output. An empty split is loaded (masked) as max
  MASK_VALUE, sum 0, acc 0, the finite stand-in for (-inf, 0, 0): it contributes exactly
  nothing and no NaN, even for a context of one key over 16 splits.
* ``num_splits`` is static (a power of two, part of the compiled decode bucket; lengths never
  recompile); ``decode_num_splits`` sizes it from max_model_len and the bucket's programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_common import (
    MASK_VALUE,
    kernel_init_state,
    key_step,
    kv_head_spec,
    launch_config,
    window_start_tile,
)
from pallas_kernels.common import layer_operand, next_pow2, whole_block_spec


def _decode_partition(seq_len, p, num_splits: int, block_k: int,
                      sliding_window: int | None):
    """Key tiles [start, end) of split ``p`` of a decode context of ``seq_len`` keys: the key
    tiles the query sees (cdiv(seq_len, KB) of them, or with a ``sliding_window`` those from
    the tile where its window starts) are dealt out in runs of cdiv(tiles, num_splits), so every
    sequence spreads over all splits whatever its length (a short one fills the first splits
    and leaves the rest empty: start >= end). The split kernel and the combine both use it."""
    num_tiles = pl.cdiv(seq_len, block_k)
    first = window_start_tile(seq_len - 1, sliding_window, block_k)
    per_split = pl.cdiv(num_tiles - first, num_splits)
    start = first + p * per_split
    return start, jnp.minimum(start + per_split, num_tiles)


def _decode_split_kernel(layer_ref, bt_ref, seq_lens_ref, qsl_ref, q_ref, k_ref, v_ref, acc_ref,
                         m_ref, l_ref, *, scale: float, group: int, rows: int, block_k: int,
                         num_splits: int, sliding_window: int | None,
                         logits_soft_cap: float | None):
    """Split-K decode, pass 1: program (s, p, h) runs the online softmax of the G query heads
    of KV head h of sequence s over the key tiles of split p and writes the unnormalised
    accumulator, running max and running sum of each head to the scratch outputs. Padding
    sequences (q_len 0) and empty splits write nothing; the combine never reads those."""
    s = pl.program_id(0)
    p = pl.program_id(1)
    h = pl.program_id(2)
    num_heads, head_dim = q_ref.shape[1], q_ref.shape[2]
    tok = qsl_ref[s]
    q_len = qsl_ref[s + 1] - tok
    seq_len = seq_lens_ref[s]
    kb_start, kb_end = _decode_partition(seq_len, p, num_splits, block_k, sliding_window)

    @pl.when((q_len > 0) & (kb_start < kb_end))
    def _():
        g = jnp.arange(rows)  # row g: query head h * G + g; rows >= G are padding
        row_ok = g < group
        head_idx = jnp.where(row_ok, h * group + g, num_heads)  # out of bounds when masked
        d = jnp.arange(head_dim)
        q = plgpu.load(q_ref.at[tok, head_idx[:, None], d[None, :]], mask=row_ok[:, None],
                       other=0.0)
        q_pos = jnp.full((rows,), seq_len - 1)  # the decode token is the context's last
        body = functools.partial(key_step, bt_ref, k_ref, v_ref, layer_ref[0], s, q, q_pos,
                                 seq_len, scale=scale, block_k=block_k,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        acc, m_i, l_i = lax.fori_loop(kb_start, kb_end, body,
                                      kernel_init_state(rows, head_dim))
        plgpu.store(acc_ref.at[s, p, head_idx[:, None], d[None, :]], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[s, p, head_idx], m_i, mask=row_ok)
        plgpu.store(l_ref.at[s, p, head_idx], l_i, mask=row_ok)


def _decode_combine_kernel(seq_lens_ref, qsl_ref, acc_ref, m_ref, l_ref, o_ref, *,
                           heads_pad: int, block_k: int, num_splits: int,
                           sliding_window: int | None):
    """Split-K decode, pass 2: program s merges the splits of sequence s for all its query
    heads at once, exactly (the same rescaling as one more online-softmax step per split).
    Empty splits load as (max MASK_VALUE, sum 0, acc 0), a finite stand-in for (-inf, 0, 0):
    exp(MASK_VALUE - max) is 0, or 1 times zeros, never inf - inf, so no NaN even where every
    split is empty."""
    s = pl.program_id(0)
    num_heads, head_dim = o_ref.shape[1], o_ref.shape[2]
    tok = qsl_ref[s]
    q_len = qsl_ref[s + 1] - tok
    seq_len = seq_lens_ref[s]

    @pl.when(q_len > 0)
    def _():
        head = jnp.arange(heads_pad)
        head_ok = head < num_heads
        head_idx = jnp.where(head_ok, head, num_heads)
        d = jnp.arange(head_dim)

        def merge(p, carry):
            acc, m_run, l_run = carry
            start, end = _decode_partition(seq_len, p, num_splits, block_k, sliding_window)
            ok = head_ok & (start < end)
            m_p = plgpu.load(m_ref.at[s, p, head_idx], mask=ok, other=MASK_VALUE)
            l_p = plgpu.load(l_ref.at[s, p, head_idx], mask=ok, other=0.0)
            acc_p = plgpu.load(acc_ref.at[s, p, head_idx[:, None], d[None, :]],
                               mask=ok[:, None], other=0.0)
            m_new = jnp.maximum(m_run, m_p)
            a = jnp.exp(m_run - m_new)
            b = jnp.exp(m_p - m_new)
            return acc * a[:, None] + acc_p * b[:, None], m_new, l_run * a + l_p * b

        acc, _, l_i = lax.fori_loop(0, num_splits, merge,
                                    kernel_init_state(heads_pad, head_dim))
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[tok, head_idx[:, None], d[None, :]], out.astype(o_ref.dtype),
                    mask=head_ok[:, None])


def paged_attention_split_k(q: jax.Array, kv_cache: jax.Array, layer: int | jax.Array,
                            block_tables: jax.Array, seq_lens: jax.Array,
                            query_start_loc: jax.Array, *, scale: float, num_splits: int,
                            interpret: bool, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None) -> jax.Array:
    """Split-K (flash-decoding) paged attention for max_query_len 1 (backend "pallas"):
    grid (S, num_splits, KVH) writing float32 scratch (acc [S, splits, H, D], max and sum
    [S, splits, H]), then a combine kernel over grid (S,)."""
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads = kv_cache.shape[:3]
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q, block_k, num_warps, num_stages = launch_config(group_pad, 1, head_dim, q.dtype)
    rows = block_q * group_pad  # >= 16, Triton's smallest dot tile

    qsl = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    stats_shape = (num_seqs, num_splits, num_heads)
    acc_shape = stats_shape + (head_dim,)
    acc, m_run, l_run = pl.pallas_call(
        functools.partial(_decode_split_kernel, scale=float(scale), group=group, rows=rows,
                          block_k=block_k, num_splits=num_splits,
                          sliding_window=sliding_window, logits_soft_cap=logits_soft_cap),
        grid=(num_seqs, num_splits, num_kv_heads),
        in_specs=[whole_block_spec((1,)), whole_block_spec(block_tables.shape),
                  whole_block_spec(seq_lens.shape), whole_block_spec(qsl.shape),
                  whole_block_spec(q.shape), kv_head_spec(kv_cache.shape, 0),
                  kv_head_spec(kv_cache.shape, 1)],
        out_specs=[whole_block_spec(acc_shape), whole_block_spec(stats_shape),
                   whole_block_spec(stats_shape)],
        out_shape=[jax.ShapeDtypeStruct(acc_shape, jnp.float32),
                   jax.ShapeDtypeStruct(stats_shape, jnp.float32),
                   jax.ShapeDtypeStruct(stats_shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_split",
    )(layer_operand(layer, num_layers), block_tables.astype(jnp.int32), seq_lens, qsl, q,
      kv_cache, kv_cache)
    out = pl.pallas_call(
        functools.partial(_decode_combine_kernel, heads_pad=next_pow2(num_heads),
                          block_k=block_k, num_splits=num_splits,
                          sliding_window=sliding_window),
        grid=(num_seqs,),
        in_specs=[whole_block_spec(seq_lens.shape), whole_block_spec(qsl.shape),
                  whole_block_spec(acc_shape), whole_block_spec(stats_shape),
                  whole_block_spec(stats_shape)],
        out_specs=whole_block_spec(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_attention_combine",
    )(seq_lens, qsl, acc, m_run, l_run)
    valid = jnp.arange(num_tokens) < qsl[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))

