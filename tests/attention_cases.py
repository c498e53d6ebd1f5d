"""Paged-attention cases shared by the attention kernels' tests: an independent, deliberately
naive numpy model (per sequence, query and head, the context rebuilt in logical order from its
block table, a dense causal softmax in float64; no code shared with the kernels), engine-like
inputs (`make_case`, the hypothesis strategy `cases`) and the same inputs inside padded bucket
shapes (`pad_case`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallas_kernels.paged_attention import paged_attention

HEAD_CONFIGS = [(14, 2), (12, 2), (28, 4), (4, 4), (8, 2)]  # Qwen2 ratios 7, 6, 7; then 1 and 4


def naive_attention(q, kv, layer, block_tables, seq_lens, qsl, scale, sliding_window=None,
                    logits_soft_cap=None):
    q = np.asarray(q, np.float64)
    kv = np.asarray(kv, np.float64)
    num_heads = q.shape[1]
    num_kv_heads, block_size = kv.shape[2], kv.shape[4]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        start, end, seq_len = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        q_len = end - start
        pos = np.arange(seq_len)
        blocks = np.asarray(block_tables[s])[pos // block_size]
        keys = kv[layer, 0][:, blocks, pos % block_size]  # [KVH, L, D]
        values = kv[layer, 1][:, blocks, pos % block_size]
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
            for h in range(num_heads):
                logits = keys[h // group, lo: p + 1] @ q[start + i, h] * scale
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
                w = np.exp(logits - logits.max())
                out[start + i, h] = (w / w.sum()) @ values[h // group, lo: p + 1]
    return out


# One compilation per shape instead of eager op-by-op dispatch (which compiles every small op
# and made these tests several times slower); the engine always calls inside a jit too.
_jitted = jax.jit(paged_attention, static_argnums=(2,),
                  static_argnames=("scale", "max_query_len", "backend", "num_splits",
                                   "sliding_window", "logits_soft_cap"))


@dataclass
class Case:
    q: np.ndarray
    kv: np.ndarray
    layer: int
    block_tables: np.ndarray
    seq_lens: np.ndarray
    qsl: np.ndarray
    scale: float
    max_query_len: int
    sliding_window: int | None = None  # keys a query sees, its own included; None: all
    logits_soft_cap: float | None = None  # logits -> cap * tanh(logits / cap); None: none

    def args(self, dtype=jnp.float32):
        return (jnp.asarray(self.q, dtype), jnp.asarray(self.kv, dtype), self.layer,
                jnp.asarray(self.block_tables), jnp.asarray(self.seq_lens),
                jnp.asarray(self.qsl))

    def run(self, backend, dtype=jnp.float32, max_query_len="case", num_splits=1):
        mq = self.max_query_len if max_query_len == "case" else max_query_len
        return _jitted(*self.args(dtype), scale=self.scale, max_query_len=mq, backend=backend,
                       num_splits=num_splits, sliding_window=self.sliding_window,
                       logits_soft_cap=self.logits_soft_cap)

    def expected(self, dtype=jnp.float32):
        # Round inputs to the tested dtype first so only the kernel's own arithmetic differs.
        q = np.asarray(jnp.asarray(self.q, dtype).astype(jnp.float32))
        kv = np.asarray(jnp.asarray(self.kv, dtype).astype(jnp.float32))
        return naive_attention(q, kv, self.layer, self.block_tables, self.seq_lens, self.qsl,
                               self.scale, self.sliding_window, self.logits_soft_cap)


def make_case(seqs, *, num_heads=14, num_kv_heads=2, head_dim=64, block_size=16,
              pad_tokens=0, pad_seqs=0, num_layers=2, layer=1, seed=0, extra_blocks=3,
              max_query_len=None, sliding_window=None, logits_soft_cap=None, scale=None):
    """seqs: list of (cached context before this step, q_len); q_len 0 = padding sequence."""
    rng = np.random.default_rng(seed)
    seqs = list(seqs) + [(0, 0)] * pad_seqs
    seq_lens = np.array([c + n for c, n in seqs], np.int32)
    q_lens = np.array([n for _, n in seqs], np.int32)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    need = [-(-int(s) // block_size) for s in seq_lens]
    max_blocks = max(max(need), 1) + 1  # one spare column that must be ignored
    num_blocks = sum(need) + extra_blocks
    # Physical blocks in random order; unused table entries point at arbitrary valid blocks.
    perm = rng.permutation(num_blocks)
    block_tables = rng.integers(0, num_blocks, (len(seqs), max_blocks)).astype(np.int32)
    used = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[used:used + n]
        used += n
    # Large finite values everywhere (stale blocks, slots past seq_len) so a key that should be
    # masked but is not visibly changes the result.
    kv = rng.standard_normal((num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim))
    kv[:, :, :, perm[used:]] *= 50.0
    num_tokens = int(qsl[-1]) + pad_tokens
    q = rng.standard_normal((max(num_tokens, 1), num_heads, head_dim))
    if max_query_len is None:
        max_query_len = max(int(q_lens.max()), 1)
    return Case(q.astype(np.float32), kv.astype(np.float32), layer, block_tables, seq_lens,
                qsl, head_dim ** -0.5 if scale is None else scale, max_query_len, sliding_window,
                logits_soft_cap)


@st.composite
def cases(draw, max_seqs=4, max_q=40, max_ctx=80):
    num_heads, num_kv_heads = draw(st.sampled_from(HEAD_CONFIGS))
    head_dim = draw(st.sampled_from([64, 128]))
    block_size = draw(st.sampled_from([16, 32]))
    seqs = []
    for _ in range(draw(st.integers(1, max_seqs))):
        if draw(st.booleans()):  # decode
            seqs.append((draw(st.integers(0, max_ctx)), 1))
        else:  # prefill, fresh or on top of cached context (chunked prefill / prefix hit)
            ctx = draw(st.sampled_from([0, draw(st.integers(1, max_ctx))]))
            seqs.append((ctx, draw(st.integers(1, max_q))))
    return make_case(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=block_size, pad_tokens=draw(st.integers(0, 9)),
                     pad_seqs=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**16)))


def pad_case(case, *, num_tokens=None, num_seqs=None, width=None, num_blocks=None, seed=1):
    """The same real inputs inside bigger padded shapes, as the engine's buckets make them:
    more token rows (random q, to be ignored), more sequence slots (q_len 0, random table
    rows), a wider block table and more physical blocks (random valid ids and large stale
    values in the new ones)."""
    rng = np.random.default_rng(seed)
    seqs, max_blocks = case.block_tables.shape
    tokens, blocks = case.q.shape[0], case.kv.shape[3]
    num_tokens, num_seqs = num_tokens or tokens, num_seqs or seqs
    width, num_blocks = width or max_blocks, num_blocks or blocks
    block_tables = rng.integers(0, num_blocks, (num_seqs, width)).astype(np.int32)
    block_tables[:seqs, :max_blocks] = case.block_tables
    q = np.concatenate([case.q, rng.standard_normal((num_tokens - tokens,) + case.q.shape[1:])])
    stale = 50 * rng.standard_normal(case.kv.shape[:3] + (num_blocks - blocks,)
                                     + case.kv.shape[4:])
    return Case(q.astype(np.float32), np.concatenate([case.kv, stale], axis=3).astype(np.float32),
                case.layer, block_tables,
                np.concatenate([case.seq_lens, np.zeros(num_seqs - seqs, np.int32)]),
                np.concatenate([case.qsl, np.full(num_seqs - seqs, case.qsl[-1], np.int32)]),
                case.scale, case.max_query_len, case.sliding_window, case.logits_soft_cap)
