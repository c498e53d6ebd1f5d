"""GPU-facing engine options checked on CPU: the matmul precision resolved per platform and
carried into the lowered steps, the CUDA-graph XLA flags in the core process's environment (and
accepted by the installed XLA), and the step buckets compiled in a thread pool with the same
executables as one by one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxllm.config import (
    CUDA_GRAPH_TRITON_XLA_FLAGS,
    platform_env,
    resolve_matmul_precision,
    xla_flags_with,
)
from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.engine.core import apply_platform_env
from jaxllm.model_executor.model_loader.loader import load_model
from jaxllm.worker.model_runner import MAX_COMPILE_THREADS, ModelRunner, compile_threads

ROOT = Path(__file__).resolve().parents[2]


def test_matmul_precision_resolves_per_platform(tiny_models):
    path = str(tiny_models["untied"][0])
    assert resolve_matmul_precision(None, "float32", "gpu") == "highest"
    assert resolve_matmul_precision(None, "bfloat16", "gpu") == "default"
    assert resolve_matmul_precision(None, "float16", "gpu") == "default"
    assert resolve_matmul_precision(None, "float32", "cpu") == "default"
    assert resolve_matmul_precision("high", "float32", "gpu") == "high"
    assert EngineArgs(model=path, dtype="float32").create_engine_config("gpu") \
        .matmul_precision == "highest"
    assert EngineArgs(model=path).create_engine_config("gpu").matmul_precision == "default"
    assert EngineArgs(model=path).create_engine_config("cpu").matmul_precision == "default"
    assert EngineArgs(model=path, matmul_precision="highest").create_engine_config("cpu") \
        .matmul_precision == "highest"
    with pytest.raises(ValueError, match="matmul_precision 'tf32' is not one of"):
        EngineArgs(model=path, matmul_precision="tf32")


def _runner(path, **kw) -> ModelRunner:
    loaded = load_model(path, dtype=jnp.float32, progress=False)
    return ModelRunner(loaded.config, loaded.params, dtype=jnp.float32,
                       kernel_backend="reference", block_size=16, max_model_len=64,
                       max_num_seqs=4, max_num_batched_tokens=32, **kw)


def _dot_precisions(text: str) -> set[str]:
    return {line.split("precision = [", 1)[1].split("]", 1)[0]
            for line in text.splitlines() if "stablehlo.dot_general" in line}


def test_lowered_step_carries_the_matmul_precision(tiny_models):
    path = tiny_models["untied"][0]
    highest = _runner(path, matmul_precision="highest")
    for num_tokens, max_query_len in ((1, 1), (16, 16)):
        text = highest.lower_step(num_tokens, max_query_len, 4).as_text()
        # Every dot: the layers' GEMMs, attention and the LM head.
        assert _dot_precisions(text) == {"HIGHEST, HIGHEST"}, text[:2000]
    assert _dot_precisions(_runner(path).lower_step(16, 16, 4).as_text()) \
        == {"DEFAULT, DEFAULT"}


def test_step_buckets_compile_in_a_pool_to_the_same_executables(tiny_models, monkeypatch):
    from jaxllm.worker import model_runner as runner_module

    assert compile_threads(1) == 1
    assert 1 <= compile_threads(100) <= max(1, min(len(os.sched_getaffinity(0)) // 2,
                                                    MAX_COMPILE_THREADS))
    runner = _runner(tiny_models["untied"][0])
    runner.initialize_kv_cache(8)
    # Four at once whatever this machine's default, so the results arrive out of order.
    monkeypatch.setattr(runner_module, "compile_threads", lambda num_jobs: 4)
    assert runner.compile(progress=True) > 0
    steps, prompt_steps = runner.compiled_shapes()
    assert steps == runner.bucket_shapes()
    assert sorted(prompt_steps) == sorted({t for t, _ in runner.bucket_shapes()})
    for shape in runner.bucket_shapes():
        one_by_one = runner.lower_step(*shape, 8).compile().as_text()
        assert runner.get_compiled_hlo(*shape) == one_by_one, shape


def test_cuda_graph_flags_go_to_the_core_process(tmp_path):
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/dump"}

    def env(**kw):
        return platform_env(EngineArgs(**kw).create_launch_config(), environ)

    assert env(cuda_graph_triton=True)["XLA_FLAGS"].split() == \
        ["--xla_dump_to=/tmp/dump", *CUDA_GRAPH_TRITON_XLA_FLAGS]
    assert env(cuda_graph_triton=True)["XLA_FLAGS"].endswith(
        "--xla_gpu_enable_command_buffer=+CUSTOM_CALL")
    assert env() == env(cuda_graph_triton=False) == {}  # nothing to change
    # A value the user gave for the same flag wins.
    given = "--xla_gpu_enable_command_buffer=FUSION"
    assert xla_flags_with(given, CUDA_GRAPH_TRITON_XLA_FLAGS) == given
    with pytest.raises(ValueError, match="cuda_graph_triton must be True, False or None"):
        EngineArgs(cuda_graph_triton="yes")
    # A checkpoint directory (not the embedded model, which would be joined first).
    assert not EngineArgs(model=str(tmp_path)).create_engine_config(
        "cpu").launch_config.cuda_graph_triton
    assert EngineArgs(model=str(tmp_path), cuda_graph_triton=True).create_engine_config(
        "cpu").launch_config.cuda_graph_triton


def test_cuda_graph_flags_in_process_only_before_jax_starts(monkeypatch):
    import jax

    jax.devices()  # this process's backend is up: too late for XLA_FLAGS
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    launch = EngineArgs(cuda_graph_triton=True).create_launch_config()
    with pytest.raises(RuntimeError, match="multiprocess_mode=True"):
        apply_platform_env(launch)
    assert "XLA_FLAGS" not in os.environ
    # Already there (a core process started with them): nothing to do, no error.
    monkeypatch.setenv("XLA_FLAGS", " ".join(CUDA_GRAPH_TRITON_XLA_FLAGS))
    apply_platform_env(launch)


def test_installed_xla_accepts_the_cuda_graph_flags(tiny_models):
    # XLA parses every flag of XLA_FLAGS (GPU ones too) when a backend starts, and aborts on
    # one it does not know: the spelling is checked here, on CPU. A fresh process that has not
    # started JAX sets them itself before the backend starts, as EngineCore does.
    script = textwrap.dedent(f"""
        import os
        from jaxllm.engine.arg_utils import EngineArgs
        from jaxllm.engine.core import apply_platform_env
        args = EngineArgs(model={str(tiny_models["untied"][0])!r}, cuda_graph_triton=True)
        launch = args.create_launch_config()
        apply_platform_env(launch)
        config = args.create_engine_config(launch_config=launch)
        import jax.numpy as jnp
        print(config.launch_config.cuda_graph_triton, os.environ["XLA_FLAGS"],
              float(jnp.ones(3).sum()))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", *CUDA_GRAPH_TRITON_XLA_FLAGS, "3.0"]
    # The spelling of older XLA releases is refused by this one: the check above can fail.
    env["XLA_FLAGS"] = "--legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton"
    old = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.ones(1)"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert old.returncode != 0 and "Unknown flag in XLA_FLAGS" in old.stderr
