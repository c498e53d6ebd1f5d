"""Keeping the garbage collector's full collections off a long-lived process's hot path."""

from __future__ import annotations

import gc


def freeze_gc_heap() -> None:
    """Move everything alive now (the imported libraries, the model's host objects, the
    tokenizer) into the permanent generation, which collections skip (vLLM's
    `freeze_gc_heap`). Call once, when start-up is done: a full collection of that heap holds
    the GIL for a large fraction of a second (BENCHMARKS.md, the soak), and a burst of
    requests sets one off. Objects made later are still collected; collecting first keeps
    start-up garbage from being frozen for good. Only in a process of jaxllm's own (the
    server, the engine core): in a user's process it would freeze the user's objects too."""
    gc.collect()
    gc.freeze()
