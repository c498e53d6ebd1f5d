"""Triton modules per bucket: what a GPU start-up compiles for the Pallas kernels of one step.

    python benchmarks/triton_modules.py [--model qwen2.5-0.5b] [--layers N] [--jobs N]

Lowers the runner's step (jaxllm/worker/lowering.py) of a Qwen2-shaped model (weights as shapes
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
import sys
import time
from collections.abc import Sequence
from pathlib import Path

# Run as a script, Python puts benchmarks/ on the path: add the repo root so that this
# checkout's packages are the ones imported.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxllm.model_executor.config import ModelConfig  # noqa: E402
from jaxllm.worker.lowering import lower_step_for_cuda  # noqa: E402
from pallas_kernels.checks.check_lowering import triton_modules  # noqa: E402
from pallas_kernels.checks.shapes import QWEN2_SHAPES  # noqa: E402
from pallas_kernels.checks.triton_compile import (  # noqa: E402
    ARCHES,
    compile_kernel,
    lowered_triton_kernels,
)


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
        lowered = lower_step_for_cuda(config, num_tokens, decode)
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
