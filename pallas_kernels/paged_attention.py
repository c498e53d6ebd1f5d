"""Paged attention over a ragged batch that mixes prefill and decode.

Layout and metadata (shared with ``kv_write`` and the engine)::

    q:               [T, num_heads, head_dim]       T is a padded token bucket
    kv_cache:        [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
    block_tables:    [S, max_blocks_per_seq] int32  physical block of each logical block
    seq_lens:        [S] int32                      context length including this step's tokens
    query_start_loc: [S+1] int32                    sequence s owns query rows qsl[s]:qsl[s+1]

Query i of sequence s sits at absolute position ``seq_lens[s] - q_len_s + i`` and attends to keys
``0..position`` (with a sliding window W: ``position - W + 1..position``); that one rule covers
prefill, chunked prefill on top of cached context (prefix hits) and decode (q_len 1), so one
code path serves any mix of them.

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
  position are masked with a finite value so no row ever computes inf - inf. With a static
  ``sliding_window`` W, keys at or before position - W are masked too and the walk starts at
  the key tile of the tile's first query's window (tiles wholly before every row's window are
  never loaded), so a query's cost is bounded by W, not by its position. Keys past the end
  are loaded as zeros so stale cache contents cannot leak NaN through p * V.
* Tile sizes (``attention_common.launch_config``): for bfloat16, M = BQ x Gp is 128 rows
  (head_dim 64) or 64 (head_dim 128) for prefill and KB = 64 keys per step; float32 takes
  M = 32 and KB = 32 (its FMA dots hold whole operand rows in registers). A pure decode step
  (max_query_len 1) has BQ = max(1, 16 // Gp), i.e. M = 16, Triton's smallest dot tile. Every
  tl.dot is thus >= 16 in M, N and K.
* Precision: bf16 inputs go to the tensor cores as bf16 with float32 accumulation (p is
  rounded to bf16 before P @ V, as in any flash kernel); float32 inputs use IEEE float32 dots
  (Precision.HIGHEST, not TF32) so that they match the reference to ~1e-5.
* Addressing: offsets are 32-bit unless the cache array exceeds 4 GiB, in which case the
  Pallas Triton lowering switches to 64-bit offsets on its own (checked in the lowering cases,
  whose all-layer caches are > 4 GiB for the larger models and in the 60 GiB ``_kv60g`` cases).
* The layer is an operand ([1] int32) that the kernel reads and indexes the KV array with, not
  a constant of its BlockSpec: every layer runs the same Triton module, compiled once per
  bucket.
* Rows of padding tokens (>= query_start_loc[-1]) belong to no program; the wrapper zeroes them
  after the call (one cheap select) rather than launching programs just to write zeros.

Split-K decode (``num_splits`` > 1, flash-decoding) lives in split_k_decode.py, the plain XLA
version (``backend="reference"``, the engine's CPU path) in reference_attention.py; the public
``paged_attention`` below dispatches to them. attention_common.py holds what the kernels share.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention_common import (
    check_soft_cap,
    kernel_init_state,
    key_step,
    kv_head_spec,
    launch_config,
    window_start_tile,
)
from pallas_kernels.common import check_backend, layer_operand, next_pow2, whole_block_spec
from pallas_kernels.reference_attention import paged_attention_reference
from pallas_kernels.split_k_decode import paged_attention_split_k


def _paged_attention_kernel(layer_ref, bt_ref, seq_lens_ref, qsl_ref, q_ref, k_ref, v_ref, o_ref,
                            *, scale: float, group: int, group_pad: int, block_q: int,
                            block_k: int, sliding_window: int | None,
                            logits_soft_cap: float | None):
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

        body = functools.partial(key_step, bt_ref, k_ref, v_ref, layer_ref[0], s, q, q_pos,
                                 kv_end, scale=scale, block_k=block_k,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        # A window starts the walk at the tile where the tile's first query's window starts.
        kb_start = window_start_tile(ctx_len + tile_start, sliding_window, block_k)
        acc, m_i, l_i = lax.fori_loop(kb_start, pl.cdiv(kv_end, block_k), body,
                                      kernel_init_state(rows_per_tile, head_dim))
        # Every real row sees its own key, so l > 0 there; the guard only keeps masked rows
        # finite.
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(o_ref.at[tok_idx, head_idx, d[None, :]], out.astype(o_ref.dtype),
                    mask=row_ok[:, None])


def _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens, query_start_loc, *,
                            scale, max_query_len, interpret, sliding_window, logits_soft_cap):
    num_tokens, num_heads, head_dim = q.shape
    num_layers, _, num_kv_heads = kv_cache.shape[:3]
    num_seqs = block_tables.shape[0]
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    qmax = num_tokens if max_query_len is None else max(1, min(int(max_query_len), num_tokens))
    block_q, block_k, num_warps, num_stages = launch_config(group_pad, qmax, head_dim,
                                                             q.dtype)

    kernel = functools.partial(_paged_attention_kernel, scale=float(scale), group=group,
                               group_pad=group_pad, block_q=block_q, block_k=block_k,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    grid = (num_seqs, pl.cdiv(qmax, block_q), num_kv_heads)

    qsl = query_start_loc.astype(jnp.int32)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole_block_spec((1,)), whole_block_spec(block_tables.shape),
                  whole_block_spec(seq_lens.shape),
                  whole_block_spec(qsl.shape), whole_block_spec(q.shape),
                  kv_head_spec(kv_cache.shape, 0), kv_head_spec(kv_cache.shape, 1)],
        out_specs=whole_block_spec(q.shape),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention",
    )(layer_operand(layer, num_layers), block_tables.astype(jnp.int32),
      seq_lens.astype(jnp.int32), qsl, q, kv_cache, kv_cache)
    valid = jnp.arange(num_tokens) < qsl[-1]
    return jnp.where(valid[:, None, None], out, jnp.zeros((), q.dtype))


def paged_attention(q: jax.Array, kv_cache: jax.Array, layer: int | jax.Array,
                    block_tables: jax.Array,
                    seq_lens: jax.Array, query_start_loc: jax.Array, *, scale: float,
                    max_query_len: int | None = None, backend: str = "reference",
                    num_splits: int = 1, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None) -> jax.Array:
    """Causal attention of a ragged batch of queries against the paged KV cache.

    q: [T, num_heads, head_dim]; rows at index >= query_start_loc[-1] are padding.
    kv_cache: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim].
    layer: a Python int, or a scalar (or one-element) integer array, traced or not; the
    kernels read it from an operand, so one compiled kernel serves every layer.
    block_tables: [S, max_blocks_per_seq] int32 physical block ids (unused entries ignored).
    seq_lens: [S] int32 context length including this step's tokens (already written).
    query_start_loc: [S+1] int32 cumulative query lengths.
    Query i of sequence s sits at position seq_lens[s] - q_len_s + i and sees keys 0..position.
    max_query_len: static bound on any q_len (None -> T).
    num_splits: static power of two; > 1 selects split-K decode (flash-decoding: each context
    is cut into num_splits parts that run in parallel, then merged exactly), which needs
    max_query_len == 1; ``attention_common.decode_num_splits`` sizes it. The reference backend
    computes the same attention unsplit.
    sliding_window: static; a query at position p then sees keys p - sliding_window + 1 .. p
    only (Hugging Face's window), and the kernels skip the key tiles wholly before it. None:
    keys 0..p, the same compiled code as without the argument.
    logits_soft_cap: static; each scaled logit x becomes cap * tanh(x / cap) before the mask
    and softmax (Gemma 2's attention soft cap, vLLM's ``logits_soft_cap``). None: no cap, the
    same compiled code as without the argument.
    Returns [T, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    check_backend(backend)
    num_splits = int(num_splits)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    if num_splits > 1 and max_query_len != 1:
        raise ValueError(f"num_splits > 1 is for decode steps (max_query_len 1), got "
                         f"max_query_len={max_query_len}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or int(sliding_window) != sliding_window \
                or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive integer or None, got "
                             f"{sliding_window!r}")
        sliding_window = int(sliding_window)
    logits_soft_cap = check_soft_cap(logits_soft_cap)
    if backend == "reference":
        return paged_attention_reference(q, kv_cache, layer, block_tables, seq_lens,
                                         query_start_loc, scale=scale,
                                         max_query_len=max_query_len,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
    if num_splits > 1:
        return paged_attention_split_k(
            q, kv_cache, layer, block_tables, seq_lens, query_start_loc, scale=scale,
            num_splits=num_splits, interpret=backend == "interpret",
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    return _paged_attention_pallas(q, kv_cache, layer, block_tables, seq_lens, query_start_loc,
                                   scale=scale, max_query_len=max_query_len,
                                   interpret=backend == "interpret",
                                   sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)
