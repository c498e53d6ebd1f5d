"""The cases check_lowering and check_compile lower for CUDA: per kernel module, a builder
``(model, dtype, phase) -> [(kernel_name, fn, ShapeDtypeStruct args)]`` at a model's shapes
(a ``shapes.Qwen2Shape``) for the phase: "decode" (64 sequences of one token, contexts up to
4096; paged attention adds a speculative-decoding verify step, ``paged_attention_verify``),
"decode1" (batch-1 decode: one sequence, one token) or "prefill" (2048 tokens over 4
sequences). Every ``fn`` calls the kernel's public function with backend "pallas".

The KV array of the write_kv and paged attention cases holds 64 sequences x 4096 tokens on
every layer; where that is at most 4 GiB (Qwen2.5-0.5B in bfloat16: 3.2 GB), the kernels address
it with 32-bit offsets, so those cases come again (suffix ``_kv60g``) with an array the size of
an H100's KV budget, 60 GiB, which takes the 64-bit path a GPU engine runs."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.attention_common import decode_num_splits
from pallas_kernels.checks.shapes import Qwen2Shape
from pallas_kernels.dequant_matmul import GEMM_MIN_ROWS, dequant_matmul
from pallas_kernels.kv_write import write_kv
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rope import rope
from pallas_kernels.rope_write_kv import rope_write_kv
from pallas_kernels.skinny_matmul import skinny_matmul

Case = tuple[str, Callable, tuple]

# Tokens of each phase's step.
PHASE_TOKENS = {"decode": 64, "decode1": 1, "prefill": 2048}
# The cases' KV array: 64 sequences x 4096 tokens, in blocks of the case's size.
CASE_KV_TOKENS = 64 * 4096
# A speculative-decoding verify step (the runner's spec-decode bucket): VERIFY_SEQS sequences of
# 1 + k tokens each, k = 5 draft tokens, max_query_len 1 + k. Paged attention sizes its query
# tile from max_query_len (attention_common.launch_config), so the step's tile is neither
# decode's nor prefill's; no other kernel reads max_query_len, so only attention gets the case.
VERIFY_SEQS = 16
VERIFY_QUERY_LEN = 6
# An H100's KV budget (80 GB less weights and activations), for the models whose usual case
# array is small enough for 32-bit offsets.
LARGE_KV_BYTES = 60 * 2**30
LARGE_KV_SUFFIX = "_kv60g"


def _tokens(phase: str) -> int:
    if phase not in PHASE_TOKENS:
        raise ValueError(f"unknown phase {phase!r}; expected one of {tuple(PHASE_TOKENS)}")
    return PHASE_TOKENS[phase]


def kv_arrays(model: Qwen2Shape, dtype, block_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """(case name suffix, KV array shape) of the arrays a case runs at: the usual one and,
    where that is at most 4 GiB, one of LARGE_KV_BYTES (64-bit offsets)."""
    def shape(num_blocks):
        return (model.num_layers, 2, model.num_kv_heads, num_blocks, block_size, model.head_dim)

    usual = shape(CASE_KV_TOKENS // block_size)
    arrays = [("", usual)]
    block_bytes = math.prod(shape(1)) * jnp.dtype(dtype).itemsize
    if block_bytes * usual[3] <= 2**32:
        arrays.append((LARGE_KV_SUFFIX, shape(LARGE_KV_BYTES // block_bytes)))
    return arrays


def rms_norm_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """The plain norm and the fused residual-add + norm."""
    tokens = _tokens(phase)
    x = jax.ShapeDtypeStruct((tokens, model.hidden_size), dtype)
    w = jax.ShapeDtypeStruct((model.hidden_size,), dtype)
    eps = 1e-6

    def plain(x, w):
        return rms_norm(x, w, eps, backend="pallas")

    def fused(x, r, w):
        return rms_norm(x, w, eps, r, backend="pallas")

    return [("rms_norm", plain, (x, w)), ("rms_norm+residual", fused, (x, x, w))]


def rope_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    tokens = _tokens(phase)
    q = jax.ShapeDtypeStruct((tokens, model.num_heads, model.head_dim), dtype)
    k = jax.ShapeDtypeStruct((tokens, model.num_kv_heads, model.head_dim), dtype)
    pos = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    cache = jax.ShapeDtypeStruct((32768, model.head_dim), dtype)

    def fn(q, k, pos, cache):
        return rope(q, k, pos, cache, backend="pallas")

    return [("rope", fn, (q, k, pos, cache))]


def kv_write_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """``write_kv`` of the phase's tokens into the last layer of the KV array (``kv_arrays``:
    blocks of 16; > 4 GiB, so on the 64-bit addressing path, for the larger models and for
    the ``_kv60g`` case)."""
    num_tokens = _tokens(phase)
    layer = model.num_layers - 1
    kv = (num_tokens, model.num_kv_heads, model.head_dim)

    def fn(kv_cache, k, v, slot_mapping):
        return write_kv(kv_cache, layer, k, v, slot_mapping, backend="pallas")

    return [(f"write_kv{suffix}", fn,
             (jax.ShapeDtypeStruct(cache, dtype), jax.ShapeDtypeStruct(kv, dtype),
              jax.ShapeDtypeStruct(kv, dtype), jax.ShapeDtypeStruct((num_tokens,), jnp.int32)))
            for suffix, cache in kv_arrays(model, dtype, 16)]


def rope_write_kv_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """The QKV epilogue (bias, RoPE, the KV write) of the phase's tokens into the last layer
    of the KV array (``kv_arrays``, as ``kv_write_cases``)."""
    num_tokens = _tokens(phase)
    layer = model.num_layers - 1
    heads, kv_heads = model.num_heads, model.num_kv_heads
    width = (heads + 2 * kv_heads) * model.head_dim

    def fn(qkv, bias, pos, cos_sin, kv_cache, slot_mapping):
        return rope_write_kv(qkv, bias, pos, cos_sin, kv_cache, layer, slot_mapping,
                             num_heads=heads, num_kv_heads=kv_heads, backend="pallas")

    return [(f"rope_write_kv{suffix}", fn,
             (jax.ShapeDtypeStruct((num_tokens, width), dtype),
              jax.ShapeDtypeStruct((width,), dtype),
              jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
              jax.ShapeDtypeStruct((32768, model.head_dim), jnp.float32),
              jax.ShapeDtypeStruct(cache, dtype), jax.ShapeDtypeStruct((num_tokens,), jnp.int32)))
            for suffix, cache in kv_arrays(model, dtype, 16)]


def paged_attention_cases(model: Qwen2Shape, dtype, phase: str,
                          sliding_window: int | None = None,
                          logits_soft_cap: float | None = None) -> list[Case]:
    """decode: 64 sequences x 1 token, contexts up to 4096 (256 blocks of 16), max_query_len 1;
    split-K decode of 8 sequences (a small batch) with ``decode_num_splits`` for a
    max_model_len of 4096 (16 splits for 2 KV heads, 8 for 4): two kernels, split and combine;
    and the verify step of speculative decoding (``paged_attention_verify``): 16 sequences x 6
    tokens (1 + k, k = 5), max_query_len 6, contexts up to 4096, unsplit. decode1: one sequence
    of one token, unsplit (a max_model_len too short to split) and split-K (16 splits).
    prefill: 2048 tokens over 4 sequences, blocks of 16 and of 32, max_query_len 2048. The KV
    array spans all layers (``kv_arrays``), > 4 GiB for the larger models and in the ``_kv60g``
    cases (blocks of 16), so the 64-bit addressing path of the Triton lowering is exercised
    too. ``sliding_window``, ``logits_soft_cap``: the same cases with that window and logit
    soft cap (tests/kernels/test_lowering.py).
    """
    max_model_len = 4096
    attn, splitk = "paged_attention", "paged_attention_splitk"
    if phase == "decode":
        # name, tokens, sequences, max_query_len, block_size, num_splits
        shapes = [(attn, 64, 64, 1, 16, 1),
                  (splitk, 8, 8, 1, 16, decode_num_splits(max_model_len, 8, model.num_kv_heads)),
                  ("paged_attention_verify", VERIFY_SEQS * VERIFY_QUERY_LEN, VERIFY_SEQS,
                   VERIFY_QUERY_LEN, 16, 1)]
    elif phase == "decode1":
        shapes = [(attn, 1, 1, 1, 16, 1),
                  (splitk, 1, 1, 1, 16, decode_num_splits(max_model_len, 1, model.num_kv_heads))]
    elif phase == "prefill":
        shapes = [(attn, 2048, 4, 2048, 16, 1), (attn, 2048, 4, 2048, 32, 1)]
    else:
        raise ValueError(f"unknown phase {phase!r}")
    num_layers = model.num_layers
    cases = []
    for name, num_tokens, num_seqs, max_query_len, block_size, num_splits in shapes:
        max_blocks = max_model_len // block_size

        def fn(q, kv_cache, block_tables, seq_lens, query_start_loc, _mq=max_query_len,
               _ns=num_splits):
            return paged_attention(q, kv_cache, num_layers - 1, block_tables, seq_lens,
                                   query_start_loc, scale=model.head_dim ** -0.5,
                                   max_query_len=_mq, backend="pallas", num_splits=_ns,
                                   sliding_window=sliding_window,
                                   logits_soft_cap=logits_soft_cap)

        for suffix, cache in kv_arrays(model, dtype, block_size):
            if suffix and block_size != 16:
                continue  # the large array's addressing does not depend on the block size
            args = (jax.ShapeDtypeStruct((num_tokens, model.num_heads, model.head_dim), dtype),
                    jax.ShapeDtypeStruct(cache, dtype),
                    jax.ShapeDtypeStruct((num_seqs, max_blocks), jnp.int32),
                    jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
                    jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))
            cases.append((f"{name}_bs{block_size}{suffix}", fn, args))
    return cases


# (layer, block size, with offsets) of each Qwen2 matmul checked; a Q4_K_M GGUF keeps down_proj
# in Q6_K (16-value blocks, no mins) and most others in Q4_K / Q5_K (32 values, with mins).
DEQUANT_LAYERS: tuple[tuple[str, int, bool], ...] = (
    ("qkv", 32, True), ("o", 32, True), ("gate_up", 32, True), ("down", 16, False))
# Rows per phase: the largest GEMV decode bucket, a 64-sequence decode step, batch-1 decode,
# a prefill chunk.
DEQUANT_ROWS = {"decode": (8, 64), "decode1": (1,), "prefill": (2048,)}


def matmul_shape(model: Qwen2Shape, layer: str) -> tuple[int, int]:
    """(N, K) of a Qwen2 layer matmul."""
    h, inter = model.hidden_size, model.intermediate_size
    return {"qkv": ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim, h),
            "o": (h, model.num_heads * model.head_dim), "gate_up": (2 * inter, h),
            "down": (h, inter)}[layer]


def dequant_case_name(layer: str, rows: int) -> str:
    return f"dequant_{'gemv' if rows < GEMM_MIN_ROWS else 'gemm'}_{layer}_m{rows}"


def dequant_matmul_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """Every layer matmul at the phase's row counts."""
    if phase not in DEQUANT_ROWS:
        raise ValueError(f"unknown phase {phase!r}")
    cases = []
    for layer, group, with_offset in DEQUANT_LAYERS:
        n, k = matmul_shape(model, layer)
        blocks = jax.ShapeDtypeStruct((n, k // group), jnp.float32)
        weight = (jax.ShapeDtypeStruct((n, k), jnp.int8), blocks,
                  *((blocks,) if with_offset else ()))
        for rows in DEQUANT_ROWS[phase]:
            def fn(x, *w):
                return dequant_matmul(x, *w, backend="pallas")

            cases.append((dequant_case_name(layer, rows), fn,
                          (jax.ShapeDtypeStruct((rows, k), dtype), *weight)))
    return cases


# Rows per phase of the weight-streaming GEMV: a decode bucket of 8 sequences, batch-1 decode
# (prefill chunks are GEMMs).
SKINNY_ROWS = {"decode": (8,), "decode1": (1,), "prefill": ()}


def skinny_matmul_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """Every layer matmul and the LM head at the phase's decode rows, the weight in `dtype`."""
    if phase not in SKINNY_ROWS:
        raise ValueError(f"unknown phase {phase!r}")
    shapes = [(layer, *matmul_shape(model, layer)) for layer, _, _ in DEQUANT_LAYERS]
    shapes.append(("lm_head", model.vocab_size, model.hidden_size))
    cases = []
    for layer, n, k in shapes:
        for rows in SKINNY_ROWS[phase]:
            def fn(x, w):
                return skinny_matmul(x, w, backend="pallas")

            cases.append((f"skinny_{layer}_m{rows}", fn,
                          (jax.ShapeDtypeStruct((rows, k), dtype),
                           jax.ShapeDtypeStruct((n, k), dtype))))
    return cases


# By kernel module name (check_lowering's --modules).
# Gemma 2's settings: a window and a logit soft cap together (each alone compiles a subset).
WINDOW, SOFT_CAP = 4096, 50.0


def windowed_attention_cases(model: Qwen2Shape, dtype, phase: str) -> list[Case]:
    """``paged_attention_cases`` with a sliding window and a logit soft cap, named apart."""
    return [(f"{name.replace('_bs', '_swa_cap_bs', 1)}", fn, args) for name, fn, args in
            paged_attention_cases(model, dtype, phase, sliding_window=WINDOW,
                                  logits_soft_cap=SOFT_CAP)]


LOWERING_CASES: dict[str, Callable[[Qwen2Shape, object, str], list[Case]]] = {
    "rms_norm": rms_norm_cases,
    "rope": rope_cases,
    "paged_attention": paged_attention_cases,
    "paged_attention_windowed": windowed_attention_cases,
    "kv_write": kv_write_cases,
    "rope_write_kv": rope_write_kv_cases,
    "dequant_matmul": dequant_matmul_cases,
    "skinny_matmul": skinny_matmul_cases,
}
