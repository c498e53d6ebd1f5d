"""The bench stage: jaxllm's own bench CLI (sweep, batch-1 latency with its step profile,
ragged throughput, each against Hugging Face) on random checkpoints at real shapes, and the
batch-1 decode step with and without CUDA graphs over the Triton calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.harness import ROOT, StageRun, platform_check
from benchmarks.gpu.realshape import shape_named


def step_ms(doc: dict[str, Any]) -> float | None:
    """The batch-1 decode step's milliseconds in a latency run's step profile."""
    measured = [p["step_ms"] for p in doc.get("profile", []) if "step_ms" in p]
    return measured[0] if measured else None


def write_random_checkpoint(shape, path: Path, seed: int = 0, same_layers: bool = False) -> None:
    """A Hugging Face Qwen2 checkpoint of random bfloat16 weights at `shape`, written a tensor
    at a time (the bench CLI and HF load it like a real one). `same_layers`: every layer gets
    layer 0's tensors, so a 7B-shaped checkpoint costs one layer's random numbers (the step's
    time does not depend on the values)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = shape.hf_config(max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                          architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16",
                          bos_token_id=0, eos_token_id=1)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, \
        shape.num_kv_heads * shape.head_dim

    def rand(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, ml_dtypes.bfloat16)

    save_file({"model.embed_tokens.weight": rand(shape.vocab_size, h),
               "model.norm.weight": ones(h),
               **({} if shape.tied_embeddings else
                  {"lm_head.weight": rand(shape.vocab_size, h)})},
              str(path / "model-embed.safetensors"))
    weight_map = {"model.embed_tokens.weight": "model-embed.safetensors",
                  "model.norm.weight": "model-embed.safetensors"}
    if not shape.tied_embeddings:
        weight_map["lm_head.weight"] = "model-embed.safetensors"
    layer: dict[str, np.ndarray] = {}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        if not (same_layers and layer):
            layer = {"self_attn.q_proj.weight": rand(q, h), "self_attn.q_proj.bias": rand(q),
                     "self_attn.k_proj.weight": rand(kv, h), "self_attn.k_proj.bias": rand(kv),
                     "self_attn.v_proj.weight": rand(kv, h), "self_attn.v_proj.bias": rand(kv),
                     "self_attn.o_proj.weight": rand(h, q),
                     "mlp.gate_proj.weight": rand(shape.intermediate_size, h),
                     "mlp.up_proj.weight": rand(shape.intermediate_size, h),
                     "mlp.down_proj.weight": rand(h, shape.intermediate_size),
                     "input_layernorm.weight": ones(h), "post_attention_layernorm.weight": ones(h)}
        save_file({p + k: v for k, v in layer.items()},
                  str(path / f"model-layer{i:03d}.safetensors"))
        for key in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                    "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                    "mlp.down_proj.weight", "input_layernorm.weight",
                    "post_attention_layernorm.weight"):
            weight_map[p + key] = f"model-layer{i:03d}.safetensors"
    # The index names each tensor's file: Hugging Face reads several files through it.
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=1))


def bench_cli(run: StageRun, out: Path, args: list[str]) -> tuple[int, dict[str, Any], str]:
    """`jaxllm bench ARGS --output-json OUT` in a child process, given the stage's time left
    (at least 30 s); returns its exit status, its JSON ({} if none) and its output's tail."""
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli.main", "bench", *args,
           "--output-json", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=max(30.0, run.seconds_left()))
    doc = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, doc, (proc.stdout + proc.stderr)[-1500:]


def stage_bench(run: StageRun) -> None:
    sizes = run.sizes
    if run.check("platform", lambda: platform_check(sizes)) is None:
        return
    from pallas_kernels.checks.perf_model import decode_step

    work = Path(tempfile.mkdtemp(prefix="gpu_checks_bench_"))
    n = sizes.bench_len
    dtype = "bfloat16" if not sizes.dry_run else "float32"
    engine = ["--dtype", dtype, "--kernel-backend", sizes.engine_backend,
              "--skip-tokenizer-init", "--max-model-len", str(4 * n + 16), "--no-progress",
              "--max-num-batched-tokens", str(sizes.bench_tokens)]

    def cli(name: str, model: Path, *args: str) -> tuple[int, dict[str, Any], str]:
        return bench_cli(run, run.out_dir / f"bench_{name}.json", [*args, "--model", str(model),
                                                                   *engine])

    for name in sizes.bench_models:
        shape = shape_named(name)
        model = work / name
        # One KV budget: the largest sweep batch at its full length, with room to spare.
        blocks = str(2 * max(sizes.bench_batch_sizes) * -(-(2 * n + 16) // 16) + 8)

        def make(shape=shape, model=model) -> dict[str, Any]:
            start = time.perf_counter()
            write_random_checkpoint(shape, model)
            return {"ok": True, "model": shape.name, "write_s": time.perf_counter() - start}

        if run.check(f"{name}_checkpoint", make) is None:
            continue

        def sweep(name=name, model=model, blocks=blocks) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_sweep", model, "sweep", "--batch-sizes",
                                *map(str, sizes.bench_batch_sizes), "--input-len", str(n),
                                "--output-len", str(n), "--compare-hf", "--num-kv-blocks", blocks)
            return {"ok": rc == 0 and bool(doc), "result": doc, "tail": tail}

        run.check(f"{name}_sweep", sweep)

        def latency_args(blocks: str = blocks) -> list[str]:
            return ["latency", "--batch-size", "1", "--input-len", str(n), "--output-len",
                    str(n), "--num-iters", "1" if sizes.dry_run else "5",
                    "--num-iters-warmup", "1", "--profile", "--profile-batch-sizes", "1",
                    "--profile-input-len", str(n), "--num-kv-blocks", blocks]

        def latency(name=name, model=model, shape=shape) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_latency", model, *latency_args(), "--compare-hf",
                                "--no-cuda-graph-triton")
            measured = step_ms(doc)
            est = decode_step(shape, 1, n, dtype)
            return {"ok": rc == 0 and measured is not None, "cuda_graph_triton": False,
                    "measured_decode_step_ms": measured,
                    "h100_model_step_ms": 1e3 * est.step_split_s,
                    "h100_model_bound_ms": 1e3 * est.bound_s, "result": doc, "tail": tail}

        lat = run.check(f"{name}_latency_batch1", latency)

        def cuda_graphs(name=name, model=model, lat=lat) -> dict[str, Any]:
            # The same command with XLA's CUDA graphs over custom calls, less the Hugging Face
            # run (the step profile runs apart from it): the bench CLI is its own process, so
            # the flag is in XLA_FLAGS before JAX starts there (on CPU XLA accepts the flag and
            # nothing changes).
            rc, doc, tail = cli(f"{name}_latency_cuda_graph", model, *latency_args(),
                                "--cuda-graph-triton")
            on = step_ms(doc)
            off = None if lat is None else lat["measured_decode_step_ms"]
            return {"ok": rc == 0 and on is not None and off is not None,
                    "decode_step_ms_cuda_graph_off": off, "decode_step_ms_cuda_graph_on": on,
                    "speedup": None if not (on and off) else off / on,
                    "result": doc, "tail": tail}

        run.check(f"{name}_cuda_graph_ab", cuda_graphs)

        def throughput(name=name, model=model, blocks=blocks) -> dict[str, Any]:
            rc, doc, tail = cli(f"{name}_throughput", model, "throughput", "--num-prompts",
                                str(sizes.bench_prompts), "--random-input-range", "1",
                                str(2 * n), "--random-output-range", "1", str(n),
                                "--ignore-eos", "--compare-hf", "--profile",
                                "--profile-batch-sizes", "1", "--profile-input-len", str(n),
                                "--num-kv-blocks", blocks)
            return {"ok": rc == 0 and bool(doc), "result": doc, "tail": tail}

        run.check(f"{name}_throughput_ragged", throughput)
