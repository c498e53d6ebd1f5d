#!/usr/bin/env bash
# Create or refresh .venv/ at the repo root; reinstall only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
have="$(cat .venv/.jaxllm-installed 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
    echo "$want" > .venv/.jaxllm-installed
fi
