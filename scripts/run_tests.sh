#!/usr/bin/env bash
# The test suite (CPU). Extra arguments go to pytest.
#   bash scripts/run_tests.sh            Python 3.11 + JAX 0.10.2 (.venv/): the whole suite
#   bash scripts/run_tests.sh --jax011   CPython 3.13 + JAX 0.11.2 (.venv-jax011/): all but
#                                        JAX011_IGNORE
set -euo pipefail
cd "$(dirname "$0")/.."

# The second lane: the whole suite but the modules that import torch (the Hugging Face oracle,
# not installed there: its cp313 wheel is a CUDA build), the real-model tests and the Ray data-
# parallel test (Ray is the first lane's, extra "test"). Tests whose oracle is HF skip with that
# reason; those needing only a tiny checkpoint have it written by .venv/'s interpreter
# (save_tiny_checkpoint in tests/utils.py).
JAX011_IGNORE=(
    tests/model/test_gguf_quant.py tests/model/test_model_parity.py tests/model/test_real_model.py
    tests/engine/test_backends_e2e.py tests/kernels/test_gguf_kernel.py
    tests/model/test_cpu_int8_activations.py tests/model/test_model_families.py
    tests/model/test_moe_models.py tests/model/test_phi_granite_models.py
    tests/model/test_gemma_models.py tests/model/test_gemma_gguf.py
    tests/model/test_olmo2_models.py
    tests/engine/test_data_parallel_ray.py tests/lora/test_lora.py
)
# The first lane leaves to the second what a GPU machine checks with the second lane's JAX
# (0.11.2): compiling every kernel to sm_90a machine code with pip triton.
LANE1_IGNORE=(tests/kernels/test_compile.py)

if [ "${1:-}" = "--jax011" ]; then
    shift
    bash scripts/ensure_venv.sh jax011
    exec .venv-jax011/bin/python -m pytest -q --durations=20 -m "not real_model" \
        "${JAX011_IGNORE[@]/#/--ignore=}" "$@"
fi
bash scripts/ensure_venv.sh
.venv/bin/ruff check .
.venv/bin/basedpyright -p .  # the repo's config only, never a pyrightconfig.json above it
exec .venv/bin/python -m pytest -q --durations=30 "${LANE1_IGNORE[@]/#/--ignore=}" "$@"  # the slowest tests, for the suite budget
