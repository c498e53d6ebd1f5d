"""What every entrypoint (LLM, the CLI) sets up once per process."""

from __future__ import annotations

import os

from jaxllm.model_executor.model_loader.default_model import cache_dir


def enable_compilation_cache() -> None:
    """Keep compiled step buckets on disk (~/.cache/jaxllm/xla) so the next start-up skips most
    of the XLA compile time. JAXLLM_COMPILATION_CACHE=0 turns it off; a cache directory the
    user configured in JAX wins. Calling it again changes nothing."""
    import jax

    if os.environ.get("JAXLLM_COMPILATION_CACHE", "1") == "0":
        return
    if jax.config.jax_compilation_cache_dir:  # pyright: ignore[reportAttributeAccessIssue]
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
    # Only the multi-second step compiles are worth a disk entry.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
