#!/usr/bin/env bash
# The test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh
.venv/bin/ruff check .
.venv/bin/basedpyright
exec .venv/bin/python -m pytest -q "$@"
