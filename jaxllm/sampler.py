"""Host-side sampler: logits rows (numpy) -> token ids, vectorised over the batch.

Each row draws from its own `numpy.random.Generator`, so a request's tokens depend only on its
seed and its own logits, never on which requests share the batch.
"""

from __future__ import annotations

import numpy as np

from jaxllm.sampling_params import SamplingParams


def sample(logits: np.ndarray, params: list[SamplingParams],
           generators: list[np.random.Generator]) -> np.ndarray:
    """logits: [R, vocab] float32, one row per request; returns [R] int64 token ids."""
    logits = np.asarray(logits, dtype=np.float32)
    out = np.argmax(logits, axis=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    for i in random_rows:
        out[i] = _sample_row(logits[i], params[i], generators[i])
    return out


def _sample_row(row: np.ndarray, p: SamplingParams, gen: np.random.Generator) -> int:
    vocab = row.shape[0]
    # Candidates first: top-k by argpartition (O(vocab)) so the sort below is over k, not vocab.
    k = p.top_k if 0 < p.top_k < vocab else vocab
    cand = np.argpartition(-row, k - 1)[:k] if k < vocab else np.arange(vocab)
    scaled = row[cand].astype(np.float64) / p.temperature
    order = np.argsort(-scaled, kind="stable")
    cand, scaled = cand[order], scaled[order]
    probs = np.exp(scaled - scaled[0])
    probs /= probs.sum()
    keep = len(probs)
    if p.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
    if p.min_p > 0.0:
        keep = min(keep, int(np.sum(probs >= p.min_p * probs[0])))
    probs = probs[:keep] / probs[:keep].sum()
    idx = int(np.searchsorted(np.cumsum(probs), gen.random(), side="right"))
    return int(cand[min(idx, keep - 1)])
