"""Benchmark of ``paged_attention_reference`` (XLA's attention: the CPU engine's where our C++
kernel is not used, benchmarks/cpu_attention.py compares the two) at Qwen2.5-0.5B shapes.

    python benchmarks/reference_attention.py [--runs N] [--old] [--cases a,b,...]

One call = one layer (14 query / 2 KV heads, head_dim 64, block 16, float32); a model step runs
24 of them. Shapes follow the engine: block tables ``--width`` blocks wide (max_model_len / 16),
``S = min(T, --max-seqs)`` sequence slots (unused ones have q_len 0) and ``max_query_len`` T
for a step with any prefill, 1 for a pure decode step. Reported: compile time of the jitted
call and the median and minimum of ``--runs`` timed calls after one warm-up (the minimum is
the steadier figure on a shared machine); "x24" is the median times 24 layers.

``--old`` also times the previous implementation (kept below for comparison only), which built
[S, max_query_len, L] logits over the whole table width L; it is run on the real sequence
count (no S padding) because with the engine's padding it takes minutes per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

# Run as a script, Python puts benchmarks/ on the path: add the repo root so that this
# checkout's pallas_kernels is the one imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.attention_common import MASK_VALUE
from pallas_kernels.checks.shapes import QWEN2_SHAPES
from pallas_kernels.reference_attention import paged_attention_reference

MODEL = QWEN2_SHAPES["qwen2.5-0.5b"]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = (MODEL.num_heads, MODEL.num_kv_heads,
                                                 MODEL.head_dim, MODEL.num_layers)
BLOCK_SIZE = 16


# --- previous implementation, for comparison only -------------------------------------------
_OLD_LOGITS_BUDGET = 1 << 25


def _old_chunk(qc, k, v, seq_lens, q_lens, q_off, scale):
    num_keys = k.shape[2]
    chunk = qc.shape[1]
    ctx = (seq_lens - q_lens)[:, None]
    q_pos = ctx + q_off + jnp.arange(chunk)[None, :]
    key = jnp.arange(num_keys)[None, None, :]
    mask = (key <= q_pos[:, :, None]) & (key < seq_lens[:, None, None])
    qc = qc.transpose(0, 2, 3, 1, 4)
    logits = jnp.einsum("skgcd,skld->skgcl", qc, k) * scale
    logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
    m = logits.max(axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(logits - m), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("skgcl,skld->skgcd", p, v).transpose(0, 3, 1, 2, 4)


def old_reference(q, kv_cache, layer, block_tables, seq_lens, query_start_loc, *, scale,
                  max_query_len=None):
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    num_seqs, max_blocks = block_tables.shape
    qmax = num_tokens if max_query_len is None else max(1, min(int(max_query_len), num_tokens))
    seq_lens = seq_lens.astype(jnp.int32)
    qsl = query_start_loc.astype(jnp.int32)
    q_lens = qsl[1:] - qsl[:-1]
    num_blocks = kv_cache.shape[3]

    def gather(which):
        x = kv_cache[layer, which].reshape(num_kv_heads, num_blocks, block_size * head_dim)
        x = jnp.take(x, block_tables.reshape(-1), axis=1, mode="clip")
        x = x.reshape(num_kv_heads, num_seqs, max_blocks * block_size, head_dim)
        return x.transpose(1, 0, 2, 3).astype(jnp.float32)

    k = gather(0)
    v = gather(1)
    num_keys = max_blocks * block_size
    rows = qsl[:-1, None] + jnp.arange(qmax)[None, :]
    qg = q[jnp.clip(rows, 0, num_tokens - 1)].astype(jnp.float32)
    qg = qg.reshape(num_seqs, qmax, num_kv_heads, group, head_dim)
    chunk = qmax
    while chunk > 1 and num_seqs * num_heads * chunk * num_keys > _OLD_LOGITS_BUDGET:
        chunk = (chunk + 1) // 2
    num_chunks = -(-qmax // chunk)
    if num_chunks == 1:
        out = _old_chunk(qg, k, v, seq_lens, q_lens, 0, scale)
    else:
        pad = num_chunks * chunk - qmax
        qg = jnp.pad(qg, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        qg = qg.reshape(num_seqs, num_chunks, chunk, num_kv_heads, group, head_dim)

        def body(args):
            qc, off = args
            return _old_chunk(qc, k, v, seq_lens, q_lens, off, scale)

        out = jax.lax.map(body, (qg.transpose(1, 0, 2, 3, 4, 5),
                                 jnp.arange(num_chunks, dtype=jnp.int32) * chunk))
        out = out.transpose(1, 0, 2, 3, 4, 5).reshape(num_seqs, num_chunks * chunk, num_heads,
                                                      head_dim)[:, :qmax]
    out = out.reshape(num_seqs, qmax, num_heads, head_dim)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, num_seqs - 1)
    idx = t - qsl[seq_of]
    valid = (t < qsl[-1]) & (idx < qmax)
    res = out[seq_of, jnp.clip(idx, 0, qmax - 1)]
    return jnp.where(valid[:, None, None], res, 0.0).astype(q.dtype)


# --- cases -----------------------------------------------------------------------------------
def cases() -> dict[str, tuple[str, list[tuple[int, int]], int]]:
    """name -> (description, [(cached context, q_len)] per real sequence, token bucket T)."""
    rng = np.random.default_rng(0)
    return {
        "a": ("decode T=S=16, ctx ~500",
              [(int(c) - 1, 1) for c in rng.integers(480, 521, 16)], 16),
        "b": ("decode T=S=64, ctx 100..1000",
              [(int(c) - 1, 1) for c in np.linspace(100, 1000, 64).round()], 64),
        "c": ("prefill T=256, 1 seq, no ctx", [(0, 256)], 256),
        "d": ("mixed T=256: 200 on 300 + 31 dec ~400",
              [(300, 200)] + [(int(c) - 1, 1) for c in rng.integers(380, 421, 31)], 256),
        "e": ("prefill chunk T=512 on 3584 cached", [(3584, 512)], 512),
    }


def make_inputs(seqs, num_tokens, num_seqs, width, num_blocks, seed=0):
    """Inputs for ``seqs`` padded to T = num_tokens and S = num_seqs slots; the real part does
    not depend on the padding, so implementations run with different S see the same batch."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((num_tokens, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    perm = rng.permutation(num_blocks)
    pad = np.random.default_rng(seed + 1)
    q_lens = [n for _, n in seqs] + [0] * (num_seqs - len(seqs))
    seq_lens = [c + n for c, n in seqs] + [0] * (num_seqs - len(seqs))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    # Unused entries point at arbitrary valid blocks, as in the engine's tables.
    block_tables = pad.integers(0, num_blocks, (num_seqs, width)).astype(np.int32)
    used = 0
    for s, n in enumerate(seq_lens):
        need = -(-n // BLOCK_SIZE)
        block_tables[s, :need] = perm[used:used + need]
        used += need
    assert used <= num_blocks
    return (jnp.asarray(q), jnp.asarray(block_tables), jnp.asarray(np.array(seq_lens, np.int32)),
            jnp.asarray(qsl))


def bench(fn, args, runs):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    out = compiled(*args)
    out.block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        compiled(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times), min(times), out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--old", action="store_true", help="also time the previous implementation")
    ap.add_argument("--cases", default="a,b,c,d,e")
    ap.add_argument("--width", type=int, default=2048, help="block table width, in blocks")
    ap.add_argument("--max-seqs", type=int, default=64, help="engine max_num_seqs (S padding)")
    ap.add_argument("--num-blocks", type=int, default=4096, help="physical blocks per layer")
    ap.add_argument("--layers", type=int, default=4, help="layers in the cache (call reads one)")
    args = ap.parse_args(argv)

    rng = np.random.default_rng(1)
    kv = jnp.asarray(rng.standard_normal(
        (args.layers, 2, NUM_KV_HEADS, args.num_blocks, BLOCK_SIZE, HEAD_DIM), np.float32))
    layer = args.layers // 2
    scale = HEAD_DIM ** -0.5
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; table width {args.width} "
          f"blocks, cache {args.layers} layers x {args.num_blocks} blocks; ms per call (one "
          f"layer), x{NUM_LAYERS} for a model step")
    header = f"{'case':40s} {'impl':4s} {'S':>4s} {'mql':>4s} {'compile s':>9s} " \
             f"{'median ms':>9s} {'min ms':>8s} {'x24 ms':>8s}"
    print(header)
    all_cases = cases()
    for name in args.cases.split(","):
        desc, seqs, num_tokens = all_cases[name]
        mql = num_tokens if any(n > 1 for _, n in seqs) else 1
        rows = [("new", max(min(num_tokens, args.max_seqs), len(seqs)), paged_attention_reference)]
        if args.old:
            rows.append(("old", len(seqs), old_reference))
        outs = {}
        for impl, num_seqs, ref in rows:
            q, bt, sl, qsl = make_inputs(seqs, num_tokens, num_seqs, args.width, args.num_blocks)

            def fn(q, kv, bt, sl, qsl, _ref=ref, _mql=mql):
                return _ref(q, kv, layer, bt, sl, qsl, scale=scale, max_query_len=_mql)

            compile_s, run_s, best_s, out = bench(fn, (q, kv, bt, sl, qsl), args.runs)
            outs[impl] = np.asarray(out)
            print(f"{name + ') ' + desc:40s} {impl:4s} {num_seqs:4d} {mql:4d} {compile_s:9.2f} "
                  f"{run_s * 1e3:9.2f} {best_s * 1e3:8.2f} {run_s * 1e3 * NUM_LAYERS:8.0f}",
                  flush=True)
        if "old" in outs:
            real = int(sum(n for _, n in seqs))
            err = float(np.abs(outs["old"][:real] - outs["new"][:real]).max())
            print(f"{'':40s} max |old - new| = {err:.2e}")


if __name__ == "__main__":
    main()
