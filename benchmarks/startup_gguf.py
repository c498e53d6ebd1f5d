"""Start-up of the default model (the embedded GGUF): the loader alone, or LLM() and a few tokens.

    python benchmarks/startup_gguf.py load   # load_model with the engine's settings for this host
    python benchmarks/startup_gguf.py llm    # jaxllm.LLM(), then greedy tokens from one prompt

Prints one JSON line: wall seconds of each phase and the process's peak resident memory
(getrusage's ru_maxrss). Run each in a fresh process: the peak is the whole process's.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("load", "llm"))
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate (llm)")
    args = parser.parse_args()

    start = time.perf_counter()
    import jax
    import jax.numpy as jnp

    from jaxllm import LLM, SamplingParams
    from jaxllm.engine.arg_utils import EngineArgs
    from jaxllm.model_executor.model_loader.loader import load_model

    result: dict = {"mode": args.mode, "import_s": time.perf_counter() - start}
    if args.mode == "load":
        t = time.perf_counter()
        config = EngineArgs().create_engine_config()
        result["config_s"] = time.perf_counter() - t
        t = time.perf_counter()
        loaded = load_model(Path(config.model_path), dtype=jnp.dtype(config.dtype), progress=True,
                            quantization=config.quantization,
                            kernel_backend=config.kernel_backend,
                            gguf_layout=config.gguf_layout)
        jax.block_until_ready(loaded.params)
        result["load_s"] = time.perf_counter() - t
        result.update(quantization=config.quantization, gguf_layout=config.gguf_layout)
    else:
        t = time.perf_counter()
        llm = LLM()
        result["llm_init_s"] = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0,
                                                                 max_tokens=args.tokens),
                           use_tqdm=False)[0]
        result["generate_s"] = time.perf_counter() - t
        result["text"] = out.outputs[0].text
    result["peak_rss_mib"] = round(_peak_rss_mib())
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                      for k, v in result.items()}))


if __name__ == "__main__":
    main()
