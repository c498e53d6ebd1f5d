"""The weight matmuls of a decode step against the device's copy bandwidth, per matmul path.

    python benchmarks/gemv_rates.py [--shape qwen2.5-0.5b] [--dtype bfloat16]
        [--rows 1 4 8 16 64] [--paths xla pallas-gemv] [--output-json F]

Random weights at a Qwen2 shape are made on the device; for each row count, one jitted program
runs every weight matmul of a decode step (per layer qkv, o, gate-up and down, chained as in the
model, then the LM head: `jaxllm/worker/matmul_timing.py`) `--repeats` times over, chained, so
that the call's own cost (on a GPU, launching a program of a few hundred arguments costs as
much as its matmuls) is spread thin; best of a few runs, per repeat. Paths:

- `xla`: XLA's dots (what the engine runs by default);
- `pallas-gemv`: the Pallas weight-streaming GEMV (`pallas_kernels/skinny_matmul.py`) for up to
  16 rows, XLA's dots above (what `--pallas-gemv-max-rows 16` runs). It needs a GPU, or
  `--interpret` on CPU (numerics only: interpret mode's time means nothing).

Per row count and path: milliseconds, the weight bytes read per millisecond (GB/s) and that as a
percentage of the device's copy bandwidth measured in the same process (read + write bytes of
an in-place scale). XLA's own options change what its dots run: set XLA_FLAGS (for example
`--xla_gpu_enable_triton_gemm=false`) before starting this script to compare them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = ("xla", "pallas-gemv")


def random_params(shape_name: str, dtype: str) -> tuple[Any, Any]:
    """(ModelConfig, the param tree) of random weights at a Qwen2 shape, made on the device."""
    import jax
    import jax.numpy as jnp

    from benchmarks.gpu.realshape import shape_named
    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from jaxllm.model_executor.models.registry import abstract_params

    config = ModelConfig.from_hf_config(shape_named(shape_name).hf_config(
        max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6))
    leaves, tree = jax.tree.flatten(abstract_params(Qwen2ForCausalLM(config,
                                                                     dtype=jnp.dtype(dtype))))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return config, jax.tree.unflatten(tree, [
        (0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
        for k, a in zip(keys, leaves, strict=True)])


def measure(shape_name: str, dtype: str, rows: list[int], paths: list[str], interpret: bool,
            reps: int = 5, copy_mib: int = 256, repeats: int = 8) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    from jaxllm.worker.machine_rates import measure_bandwidth
    from jaxllm.worker.matmul_timing import time_weight_matmuls
    from pallas_kernels.skinny_matmul import MAX_ROWS

    config, params = random_params(shape_name, dtype)
    weight_bytes = sum(int(x.nbytes) for k, v in params.items() if k != "embed_tokens"
                       or config.tie_word_embeddings for x in jax.tree.leaves(v)
                       if x.ndim == 2)
    bandwidth = measure_bandwidth(copy_mib)
    copy = bandwidth["xla_bytes_per_s"] / 1e9  # the device's in-place scale, read + write
    out: dict[str, Any] = {"shape": shape_name, "dtype": dtype,
                           "platform": jax.default_backend(),
                           "device": str(jax.devices()[0].device_kind),
                           "xla_flags": os.environ.get("XLA_FLAGS", ""),
                           "weight_bytes": weight_bytes, "bandwidth": bandwidth,
                           "repeats": repeats,
                           "copy_gbps": copy, "results": []}
    pallas = "interpret" if interpret else "pallas"
    for path in paths:
        backend, gemv_rows = ("reference", 0) if path == "xla" else (pallas, MAX_ROWS)
        times = time_weight_matmuls(params, config, jnp.dtype(dtype), max(rows), rows, reps,
                                    backend, gemv_rows, repeats)
        for n, seconds in sorted(times.items()):
            gbps = weight_bytes / seconds / 1e9
            out["results"].append({"path": path, "rows": n, "ms": 1e3 * seconds,
                                   "weight_gbps": gbps,
                                   "percent_of_copy": 100.0 * gbps / copy if copy else None})
    return out


def main(argv: list[str] | None = None) -> int:
    from pallas_kernels.checks.shapes import QWEN2_SHAPES

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b",
                        choices=[*sorted(QWEN2_SHAPES), "dry-run-tiny"])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    parser.add_argument("--interpret", action="store_true",
                        help="the Pallas GEMV in interpret mode (CPU: numerics, not speed)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=8,
                        help="the step's matmuls this many times chained in one program, so "
                             "the time of one is not the call's own cost")
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--output-json", default=None)
    ns = parser.parse_args(argv)
    import jax

    if "pallas-gemv" in ns.paths and jax.default_backend() != "gpu" and not ns.interpret:
        parser.error("the pallas-gemv path needs a GPU, or --interpret")
    doc = measure(ns.shape, ns.dtype, ns.rows, ns.paths, ns.interpret, ns.reps, ns.copy_mib,
                  ns.repeats)
    print(f"{doc['shape']} {doc['dtype']} on {doc['device']}: {doc['weight_bytes'] / 1e6:.0f} "
          f"MB of weights a step, copy {doc['copy_gbps']:.0f} GB/s; XLA_FLAGS "
          f"{doc['xla_flags'] or '(none)'}")
    for r in doc["results"]:
        pct = r["percent_of_copy"]
        print(f"  {r['path']:<12} {r['rows']:>4} rows: {r['ms']:8.3f} ms  "
              f"{r['weight_gbps']:7.1f} GB/s" + (f"  {pct:5.1f} % of copy" if pct else ""))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
