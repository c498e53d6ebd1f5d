#!/usr/bin/env bash
# Create or refresh a test venv at the repo root; reinstall only when pyproject.toml or the
# interpreter changed.
#   bash scripts/ensure_venv.sh          .venv/         Python 3.11, JAX 0.10.2 (extra "test")
#   bash scripts/ensure_venv.sh jax011   .venv-jax011/  CPython 3.13 from scripts/ensure_python.sh,
#                                                       JAX 0.11.2 (extra "jax011")
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "")
        venv=.venv extra=test
        PY="${PYTHON:-$(command -v python3.11 || command -v python3)}" ;;
    jax011)
        venv=.venv-jax011 extra=jax011
        PY="$(bash scripts/ensure_python.sh)" ;;
    *)
        echo "ensure_venv.sh: unknown target '$1' (expected no argument or 'jax011')" >&2
        exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    "$PY" -m venv "$venv"
fi
want="$(cat pyproject.toml <(readlink -f "$PY") | sha256sum | cut -d' ' -f1)"
have="$(cat "$venv/.jaxllm-installed" 2>/dev/null || true)"
if [ "$want" != "$have" ]; then
    "$venv/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[$extra]"
    echo "$want" > "$venv/.jaxllm-installed"
fi
