#!/usr/bin/env bash
# Chat with the embedded default model (Qwen2.5-Coder-0.5B-Instruct) through
# its chat template. Extra arguments go to `jaxllm chat`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh
if [ "$#" -eq 0 ]; then
    set -- "Write a Python function that checks whether a number is prime."
fi
exec .venv/bin/jaxllm chat "$@"
