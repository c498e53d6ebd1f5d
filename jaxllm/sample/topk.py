"""Top-K logits and log-sum-exp of each sampled row, computed on the device inside the step.

The host sampler then needs only [R, K] candidates and [R] normalisers instead of [R, vocab]
rows (vocabulary-sized: even numpy's argmax over them costs ms per step at 64 rows;
docs/perf/host-path.md). `jaxllm/sample/candidates.py` decides per row whether the candidates
are exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Candidates per row: >= 20 (the logprobs limit) and above the top_k people usually ask for.
TOPK = 64
# Block width of the two-stage search: the fastest measured on CPU, ahead of 64 and of plain
# lax.top_k (docs/perf/host-path.md).
_BLOCK = 32


def top_k_logits(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values [R, k] descending, token ids [R, k] int32, log-sum-exp [R]) of float32 logits.

    The values are exactly the row's k largest. Which of several tokens tied at the k-th value
    are taken is unspecified (XLA's TopK on CPU does not keep lower indices first, whatever
    its documentation says), so the host calls a row exact only where no tie crosses the cut;
    the taken ones come sorted by value, then token id, as numpy's stable sorts order them.
    Two stages: the k blocks of _BLOCK tokens with the largest maxima hold k largest values
    (every block whose maximum beats the k-th value is taken, and each block taken beside them
    holds a value equal to it), so a second top_k over those k * _BLOCK values finds them."""
    rows, vocab = logits.shape
    nb = -(-vocab // _BLOCK)
    blocks = jnp.pad(logits, ((0, 0), (0, nb * _BLOCK - vocab)),
                     constant_values=-jnp.inf).reshape(rows, nb, _BLOCK)
    block_max = blocks.max(axis=-1)
    m = block_max.max(axis=-1)
    # Without the barrier XLA fuses the exp pass with the gathers below and runs far slower.
    x, m = jax.lax.optimization_barrier((logits, m))
    lse = m + jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))
    if nb <= k:
        values, ids = jax.lax.top_k(logits, k)
    else:
        _, top_blocks = jax.lax.top_k(block_max, k)
        cand = jnp.take_along_axis(blocks, top_blocks[:, :, None], axis=1).reshape(
            rows, k * _BLOCK)
        values, pos = jax.lax.top_k(cand, k)
        ids = jnp.take_along_axis(top_blocks, pos // _BLOCK, axis=1) * _BLOCK + pos % _BLOCK
    neg, ids = jax.lax.sort((-values, ids.astype(jnp.int32)), dimension=1, num_keys=2)
    return -neg, ids, lse
