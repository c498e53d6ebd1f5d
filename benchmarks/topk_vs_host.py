"""What the device's top-K costs on this CPU against what it saves the host sampler: the step's
extra work (top-64 and log-sum-exp of R x 151,936 float32 logits inside XLA) beside the host's
greedy and seeded top-k + top-p sampling of the full rows and of the candidates. One process,
best of 10, so the numbers compare.

    python benchmarks/topk_vs_host.py [ROWS ...]   (default: 1 64 256)
"""
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxllm.benchmarks.common import repeat_ms  # noqa: E402
from jaxllm.sample.candidates import TopKLogits, exact_rows, sample_from_topk  # noqa: E402
from jaxllm.sample.metadata import SamplingMetadata  # noqa: E402
from jaxllm.sample.sampler import SamplingRow, sample  # noqa: E402
from jaxllm.sample.topk import TOPK, top_k_logits  # noqa: E402
from jaxllm.sampling_params import SamplingParams  # noqa: E402

VOCAB = 151936


def best(f, reps=10):
    return min(repeat_ms(f, reps))


rng = np.random.default_rng(0)
topk_fn = jax.jit(top_k_logits, static_argnums=1)
for rows in [int(a) for a in sys.argv[1:]] or [1, 64, 256]:
    x = rng.normal(0, 3, (rows, VOCAB)).astype(np.float32)
    x[np.arange(rows), rng.integers(0, VOCAB, rows)] += 12
    dx = jax.device_put(x)
    dev = best(lambda dx=dx: jax.block_until_ready(topk_fn(dx, TOPK)))
    vals, ids, lse = (np.asarray(a) for a in topk_fn(dx, TOPK))
    tk = TopKLogits(vals, ids, lse)
    for name, mk in (("greedy", lambda i: SamplingParams(temperature=0.0)),
                     ("seeded top_k 50 + top_p 0.9",
                      lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i))):
        ps = [mk(i) for i in range(rows)]
        full = best(lambda ps=ps, x=x: sample(
            x, [SamplingRow(p, np.random.default_rng(0)) for p in ps],
            all_sampled_logprobs=False))

        md = SamplingMetadata.from_params(ps)

        def cand(md=md, tk=tk, n=rows):
            exact_rows(md, np.zeros(n, bool), tk)
            sample_from_topk(tk, md, rng.random(n))
        print(f"{rows:4d} rows, {name}: device top-K + lse {dev:7.2f} ms; host sampling "
              f"full rows {full:7.2f} ms, candidates {best(cand):6.2f} ms")
