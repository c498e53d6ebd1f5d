"""The step shapes compiled ahead of time: token buckets (prefill and mixed steps) and decode
buckets (every request computes one token), so serving never compiles."""

from __future__ import annotations

# The smallest token bucket; below it, decode buckets only (GEMV-shaped steps).
MIN_TOKEN_BUCKET = 16


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    buckets = []
    t = MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        buckets.append(t)
        t *= 2
    buckets.append(max(max_num_batched_tokens, MIN_TOKEN_BUCKET))
    return buckets


def decode_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts of pure-decode steps: powers of two up to the first >= max_num_seqs, and
    never past what one step may hold."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    buckets = [1]
    while buckets[-1] < limit:
        buckets.append(min(buckets[-1] * 2, max_num_batched_tokens))
    return buckets
