"""What the paged attention kernel and its split-K decode kernels share: the masked-logit value,
the logit soft cap, the online-softmax step over one key tile, the tile sizes, and the split-K
factor per decode bucket (which the engine's runner and the performance model use too)."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2

# Finite stand-in for -inf: masked logits must never produce inf - inf = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def soft_cap(logits, logits_soft_cap: float | None):
    """cap * tanh(logits / cap) (Gemma 2's attention logit soft cap), applied to the scaled
    logits before the mask; None: the logits unchanged (nothing is traced)."""
    if logits_soft_cap is None:
        return logits
    return logits_soft_cap * jnp.tanh(logits / logits_soft_cap)


def check_soft_cap(logits_soft_cap) -> float | None:
    """``logits_soft_cap`` as a float (a static argument of every attention path), None as is;
    a ValueError for anything but a finite number > 0."""
    if logits_soft_cap is None:
        return None
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real) \
            or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be a finite number > 0 or None, got "
                         f"{logits_soft_cap!r}")
    return float(logits_soft_cap)


def key_step(bt_ref, k_ref, v_ref, layer, s, q, q_pos, kv_end, kb, carry, *, scale: float,
             block_k: int, sliding_window: int | None = None,
             logits_soft_cap: float | None = None):
    """One online-softmax step of the Triton kernels over key tile ``kb`` (keys kb * KB ..
    kb * KB + KB - 1) of sequence ``s``: gathers K/V of ``layer`` through the block table (keys
    at or past ``kv_end`` load as zeros), masks keys past each row's position ``q_pos`` and,
    with a ``sliding_window`` W (static), keys at or before q_pos - W; a ``logits_soft_cap``
    (static) caps the scaled logits first (``soft_cap``). A row all of whose keys
    so far were masked carries (max MASK_VALUE, sum and acc of ones-weighted values); its first
    visible key rescales that by exp(MASK_VALUE - logit) == 0, so it leaves no trace.
    k_ref, v_ref: [num_layers, num_blocks, block_size, head_dim] of one KV head. carry:
    (acc [M, D], running max [M], running sum [M]), float32."""
    acc, m_prev, l_prev = carry
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    max_blocks = bt_ref.shape[1]
    d = jnp.arange(head_dim)
    key = kb * block_k + jnp.arange(block_k)
    key_ok = key < kv_end
    col = jnp.minimum(key // block_size, max_blocks - 1)
    blk = plgpu.load(bt_ref.at[s, col], mask=key_ok, other=0)
    off = key % block_size
    kv_idx = (layer, blk[:, None], off[:, None], d[None, :])
    k = plgpu.load(k_ref.at[kv_idx], mask=key_ok[:, None], other=0.0)
    v = plgpu.load(v_ref.at[kv_idx], mask=key_ok[:, None], other=0.0)

    logits = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
    logits = soft_cap(logits, logits_soft_cap)
    mask = (key[None, :] <= q_pos[:, None]) & key_ok[None, :]
    if sliding_window is not None:
        mask = mask & (key[None, :] > q_pos[:, None] - sliding_window)
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_next = jnp.maximum(m_prev, logits.max(axis=1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.exp(logits - m_next[:, None])
    l_next = l_prev * correction + p.sum(axis=1)
    pv = plgpu.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
    return acc * correction[:, None] + pv, m_next, l_next


def window_start_tile(first_pos, sliding_window: int | None, block_k: int):
    """The first key tile of KB keys a query at ``first_pos`` (and any later one) sees: 0, or
    with a ``sliding_window`` W the tile of key first_pos - W + 1. The tiles before it are
    skipped, not masked."""
    if sliding_window is None:
        return 0
    return jnp.maximum(first_pos - sliding_window + 1, 0) // block_k


def kv_head_spec(cache_shape: tuple[int, ...], which: int) -> pl.BlockSpec:
    """The block of the KV array a program of the attention kernels sees: K (``which`` 0) or
    V (1) of its KV head (grid axis 2) in every layer, [num_layers, num_blocks, block_size,
    head_dim]. The layer is not part of the block: the kernels index it with the value of their
    layer operand, so the Triton module is the same for every layer."""
    num_layers, _, _, num_blocks, block_size, head_dim = cache_shape
    return pl.BlockSpec((num_layers, None, None, num_blocks, block_size, head_dim),
                        lambda i, j, h: (0, which, h, 0, 0, 0))


def kernel_init_state(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online-softmax carry before any key: (acc 0, running max MASK_VALUE, running sum 0)."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def launch_config(group_pad: int, max_query_len: int, head_dim: int,
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


def decode_num_splits(max_model_len: int, num_seqs: int, num_kv_heads: int, *,
                      num_sms: int = 132, min_split_len: int = 256,
                      max_splits: int = 16) -> int:
    """Split-K factor for a decode bucket of ``num_seqs`` sequences (static per bucket).

    The smallest power of two such that num_seqs x num_kv_heads x splits programs fill the
    ``num_sms`` SMs (132: H100 SXM) once, capped so that a context of ``max_model_len`` keys
    still gives each split at least ``min_split_len`` keys (shorter splits cost more in scratch
    traffic and combine than they gain), and at ``max_splits``. 1 (the unsplit kernel) when the
    bucket alone has >= num_sms programs. Contexts shorter than max_model_len spread over the
    same splits with fewer keys each (split_k_decode's partition of the key tiles); splits past
    a very short context exit at once.
    """
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    while (splits < max_splits and programs * splits < num_sms
           and 2 * splits * min_split_len <= max_model_len):
        splits *= 2
    return splits
