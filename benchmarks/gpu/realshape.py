"""The realshape stage: a ModelRunner at each real Qwen2.5 shape over random weights made on
the device (no checkpoint): the engine's KV budget rule, each step bucket's compile seconds and
XLA's memory analysis, the device's peak memory."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.harness import Sizes, StageRun, jax_module, platform_check
from pallas_kernels.checks.shapes import QWEN2_SHAPES, Qwen2Shape

# --dry-run's stand-in for the real shapes: two layers, widths with the real head layout.
DRY_RUN_SHAPE = Qwen2Shape(name="dry-run-tiny", num_layers=2, hidden_size=128, num_heads=4,
                           num_kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=512,
                           tied_embeddings=False)


def shape_named(name: str) -> Qwen2Shape:
    return DRY_RUN_SHAPE if name == DRY_RUN_SHAPE.name else QWEN2_SHAPES[name]


def random_runner(shape, sizes: Sizes, dtype: str):
    """A ModelRunner over random weights at `shape`, made on the device (no checkpoint)."""
    import jax.numpy as jnp

    from jaxllm.model_executor.config import ModelConfig
    from jaxllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from jaxllm.model_executor.models.registry import abstract_params
    from jaxllm.worker.model_runner import ModelRunner

    jax = jax_module()
    config = ModelConfig.from_hf_config(shape.hf_config(max_position_embeddings=4096,
                                                        rope_theta=1e6, rms_norm_eps=1e-6))
    model = Qwen2ForCausalLM(config, dtype=jnp.dtype(dtype), kernel_backend=sizes.engine_backend,
                             activation_dtype=jnp.dtype(dtype), tp_axis=None)
    leaves, tree = jax.tree.flatten(abstract_params(model))
    keys = jax.random.split(jax.random.key(0), len(leaves))
    params = jax.tree.unflatten(tree, [
        (0.02 * jax.random.normal(k, a.shape, jnp.float32)).astype(a.dtype)
        for k, a in zip(keys, leaves, strict=True)])
    return config, ModelRunner(config, params, dtype=jnp.dtype(dtype),
                               kernel_backend=sizes.engine_backend, block_size=16,
                               max_model_len=4096 if not sizes.dry_run else 512,
                               max_num_seqs=sizes.realshape_seqs,
                               max_num_batched_tokens=sizes.realshape_tokens)


def stage_realshape(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from jaxllm.engine.arg_utils import EngineArgs
    from jaxllm.worker.compile_counter import compile_seconds
    from jaxllm.worker.model_runner import num_kv_blocks_for

    for name in sizes.realshapes:
        def one(name: str = name) -> dict[str, Any]:
            jax = jax_module()
            shape = shape_named(name)
            dtype = "bfloat16"
            start = time.perf_counter()
            _, runner = random_runner(shape, sizes, dtype)
            jax.block_until_ready(runner.params)
            init_s = time.perf_counter() - start
            # The engine's own budget rule (kv_budget_bytes): gpu_memory_utilization x the
            # device's bytes limit - max(bytes in use, weights) - the largest step's
            # activations (the CPU default where no memory is reported).
            # The checkpoint directory holds only config.json: the runner above has the weights.
            ckpt = Path(tempfile.mkdtemp(prefix="gpu_checks_shape_"))
            (ckpt / "config.json").write_text(json.dumps(shape.hf_config()))
            config = EngineArgs(
                model=str(ckpt), dtype=dtype, kernel_backend=sizes.engine_backend,
                quantization="none", max_num_seqs=sizes.realshape_seqs,
                max_num_batched_tokens=sizes.realshape_tokens, skip_tokenizer_init=True,
                multiprocess_mode=False).create_engine_config(jax.default_backend())
            blocks = num_kv_blocks_for(config, runner)
            if sizes.dry_run:
                blocks = min(blocks, 64)  # the CPU default would take a GiB of host memory
            runner.initialize_kv_cache(blocks)
            before = len(compile_seconds())
            total = runner.compile(progress=False)
            seconds = compile_seconds()[before:]
            count = len(seconds)
            shapes = runner.bucket_table()
            # Buckets compile concurrently: the compile events' seconds, longest first, are not
            # matched to buckets.
            per_bucket = [{"bucket": [t, q], "splits": s} for t, q, s in shapes]
            analysis = [{"bucket": [t, q], **runner.get_memory_analysis(t, q)}
                        for t, q, _ in shapes]
            kv = runner.get_kv_cache_info()
            stats = jax.devices()[0].memory_stats() or {}
            result = {"ok": blocks >= 2 and count >= len(shapes),
                      "model": name, "params": shape.params(), "init_s": init_s,
                      "weight_bytes": runner.weight_bytes(), "kv_blocks": blocks,
                      "kv_bytes": kv["nbytes"], "compile_total_s": total,
                      "backend_compiles": count,
                      "backend_compile_s": sorted(seconds, reverse=True),
                      "buckets": per_bucket, "memory_analysis": analysis,
                      "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                      "bytes_limit": stats.get("bytes_limit")}
            del runner
            return result

        run.check(f"realshape_{name}", one)
        # The runner's jitted step refers back to it (a cycle): collect it, on success and on a
        # failure alike, before the next shape reads the device's bytes in use.
        gc.collect()
