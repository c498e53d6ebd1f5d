"""Triton modules per bucket: what a GPU start-up compiles for the Pallas kernels of one step.

    python benchmarks/triton_modules.py [--model qwen2.5-0.5b] [--layers N] [--jobs N]

Lowers the runner's step (jaxllm/worker/step.py) of a Qwen2-shaped model (weights as shapes
only) for CUDA, with no GPU, for a decode bucket and a prefill bucket; counts its
distinct Triton modules (XLA compiles each distinct `__gpu$xla.gpu.triton` backend_config
once), then compiles every distinct module with pip triton for sm_90a
(pallas_kernels/checks/triton_compile.py), one after another. Prints per bucket the
distinct modules by kernel, lowering seconds and compile seconds. The compile is pip triton's,
not XLA's, so the seconds estimate the Triton part of a cold GPU start-up; XLA's own compile of
the step is not in them.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

# Run as a script, Python puts benchmarks/ on the path: add the repo root so that this
# checkout's packages are the ones imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.model_executor.config import ModelConfig  # noqa: E402
from jaxllm.model_executor.models.qwen2 import (  # noqa: E402
    AttentionMetadata,
    Qwen2ForCausalLM,
    abstract_params,
    kv_cache_shape,
    rope_variables,
)
from jaxllm.worker.step import forward_step  # noqa: E402
from pallas_kernels.attention_common import decode_num_splits  # noqa: E402
from pallas_kernels.checks.check_lowering import triton_modules  # noqa: E402
from pallas_kernels.checks.shapes import QWEN2_SHAPES  # noqa: E402
from pallas_kernels.checks.triton_compile import (  # noqa: E402
    ARCHES,
    compile_kernel,
    lowered_triton_kernels,
)
from pallas_kernels.common import lower_for_cuda  # noqa: E402


def lower_step(config: ModelConfig, num_tokens: int, decode: bool, *, dtype=jnp.bfloat16,
               block_size: int = 16, num_blocks: int = 4096, max_model_len: int = 4096,
               max_num_seqs: int = 64) -> jax.stages.Lowered:
    """The runner's step with the Pallas kernels, lowered for CUDA from abstract inputs: a
    decode bucket of `num_tokens` sequences (split-K attention as the runner sizes it) or a
    prefill bucket of `num_tokens` tokens."""
    model = Qwen2ForCausalLM(config, dtype=dtype, kernel_backend="pallas")
    seqs = min(num_tokens, max_num_seqs)

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    attn_metadata = AttentionMetadata(i32(num_tokens), i32(seqs, -(-max_model_len // block_size)),
                                      i32(seqs), i32(seqs + 1), i32(seqs))
    splits = (decode_num_splits(max_model_len, seqs, config.num_key_value_heads)
              if decode else 1)
    fn = functools.partial(forward_step, model, 0, None, max_query_len=1 if decode else num_tokens,
                           num_splits=splits)
    kv = jax.ShapeDtypeStruct(kv_cache_shape(config, num_blocks, block_size), dtype)
    rope = jax.eval_shape(lambda: rope_variables(config))
    return lower_for_cuda(fn, (abstract_params(model), rope, kv, i32(num_tokens),
                               i32(num_tokens), attn_metadata), donate_argnums=2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=tuple(QWEN2_SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--no-compile", action="store_true", help="count modules only")
    ns = parser.parse_args(argv)
    shape = QWEN2_SHAPES[ns.model]
    overrides = {"rope_theta": 1e6}
    if ns.layers is not None:
        overrides["num_hidden_layers"] = ns.layers
    config = ModelConfig.from_hf_config(shape.hf_config(**overrides))
    capability = ARCHES["sm_90a"].capability
    print(f"{ns.model}, {config.num_hidden_layers} layers, bfloat16, sm_90a")
    print("| bucket | distinct modules | by kernel | lower s | compile s |")
    print("|---|---|---|---|---|")
    for bucket, num_tokens, decode in (("decode 8", 8, True), ("prefill 512", 512, False)):
        start = time.perf_counter()
        lowered = lower_step(config, num_tokens, decode)
        counts = triton_modules(lowered)
        lower_s = time.perf_counter() - start
        compile_s = 0.0
        if not ns.no_compile:
            seen = set()
            start = time.perf_counter()
            for kernel in lowered_triton_kernels(lowered):
                key = (kernel.ttir, kernel.num_warps, kernel.num_stages)
                if key in seen:
                    continue
                seen.add(key)
                stats = compile_kernel(kernel.ttir, capability, kernel.num_warps,
                                       kernel.num_stages)
                if stats.error:
                    print(f"{kernel.name}: {stats.error}", file=sys.stderr)
            compile_s = time.perf_counter() - start
        by_kernel = ", ".join(f"{name} {n}" for name, n in sorted(counts.modules.items()))
        print(f"| {bucket} | {counts.total} | {by_kernel} "
              f"| {lower_s:.1f} | {compile_s:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
