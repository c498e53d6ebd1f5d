#!/usr/bin/env bash
# The test suite (CPU). Extra arguments go to pytest (with --jax011, after JAX011_TESTS).
#   bash scripts/run_tests.sh            Python 3.11 + JAX 0.10.2 (.venv/): the whole suite
#   bash scripts/run_tests.sh --jax011   CPython 3.13 + JAX 0.11.2 (.venv-jax011/): JAX011_TESTS
set -euo pipefail
cd "$(dirname "$0")/.."

# The second lane: every file that imports neither torch (the Hugging Face oracle, not installed
# there) nor only the real model, run with -m "not real_model". Left out: test_backends_e2e,
# test_gguf_kernel, test_gguf_quant, test_model_parity (torch at import) and test_real_model.
# Tests here whose oracle is HF (the tiny_models fixture) skip with that reason; those needing
# only a checkpoint get it from .venv/'s interpreter (save_tiny_checkpoint in tests/conftest.py).
JAX011_TESTS=(
    # kernels: interpret-mode numerics, lowering for CUDA, compiling with pip triton
    tests/test_paged_attention.py tests/test_rms_norm.py tests/test_rope.py
    tests/test_kv_write.py tests/test_dequant_matmul.py tests/test_cpu_dequant_matmul.py
    tests/test_lowering.py tests/test_tp_lowering.py tests/test_compile.py
    tests/test_perf_model.py
    # scheduler, sampler, detokenizer, input batch
    tests/test_scheduler.py tests/test_block_pool.py tests/test_input_batch.py
    tests/test_sampling.py tests/test_topk_sampling.py tests/test_detokenizer.py
    # the engine on tiny-qwen2, in and out of process; the server; the CLI and benchmarks
    tests/test_engine.py tests/test_engine_proc.py tests/test_engine_requests.py tests/test_async_scheduling.py
    tests/test_api.py tests/test_openai_server.py tests/test_openai_server_shutdown.py
    tests/test_benchmark.py tests/test_loader_errors.py
    tests/test_tensor_parallel.py tests/test_tp_multihost.py
)

if [ "${1:-}" = "--jax011" ]; then
    shift
    bash scripts/ensure_venv.sh jax011
    exec .venv-jax011/bin/python -m pytest -q -m "not real_model" "${JAX011_TESTS[@]}" "$@"
fi
bash scripts/ensure_venv.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
