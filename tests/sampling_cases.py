"""Sampling inputs shared by the sampler's tests: the device's top-K of a logits array
(`device_topk`), logits shaped like a language model's (`llm_like`) and a mix of sampling
parameters covering the exact, full-row and mixed cases (`param_mix`)."""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.sample.candidates import TopKLogits
from jaxllm.sample.topk import TOPK, top_k_logits
from jaxllm.sampling_params import SamplingParams

_topk = jax.jit(top_k_logits, static_argnums=1)


def device_topk(x: np.ndarray, k: int = TOPK) -> TopKLogits:
    values, ids, lse = _topk(x, k)
    return TopKLogits(np.asarray(values), np.asarray(ids), np.asarray(lse))


def llm_like(rng, rows: int, vocab: int, spread: float = 2.0) -> np.ndarray:
    """Logits shaped like a language model's: a long tail and a few strong tokens."""
    x = rng.normal(0, spread, (rows, vocab)).astype(np.float32)
    for r in range(rows):
        x[r, rng.integers(0, vocab, 5)] += rng.uniform(3, 9, 5).astype(np.float32)
    return x


def param_mix(rng, n: int) -> list[SamplingParams]:
    """Random sampling parameters: the exact cases, the full-row ones and mixes."""
    out = []
    for _ in range(n):
        kind = rng.integers(0, 9)
        lp = [None, None, 0, 3, 20][rng.integers(0, 5)]
        t = float(rng.uniform(0.3, 1.6))
        kw = {
            0: dict(temperature=0.0),
            1: dict(temperature=t, top_k=int(rng.integers(1, 51))),
            2: dict(temperature=t, top_k=int(rng.integers(1, 51)),
                    top_p=float(rng.uniform(0.3, 0.99))),
            3: dict(temperature=t, min_p=float(rng.uniform(0.01, 0.5))),
            4: dict(temperature=t, min_p=float(rng.uniform(0.01, 0.5)),
                    top_p=float(rng.uniform(0.3, 0.99))),
            5: dict(temperature=t, top_k=int(rng.integers(1, 200)),
                    min_p=float(rng.uniform(0.0, 0.3))),
            6: dict(temperature=t),  # pure temperature: the full row
            7: dict(temperature=t, top_p=float(rng.uniform(0.3, 0.99))),  # top_p alone
            8: dict(temperature=t, top_k=TOPK),  # ties beyond K cannot be ruled out
        }[int(kind)]
        out.append(SamplingParams(logprobs=lp, seed=int(rng.integers(0, 2**31)), **kw))
    return out
