#!/usr/bin/env bash
# Run GPU check stages on a GPU machine with no package registry, from what
# scripts/gpu_prepare.sh built (docs/gpu.md):
#
#   bash scripts/gpu_validate.sh STAGE [STAGE ...] [gpu_checks.py options]
#       # STAGE: probe | kernels | tiny | realshape | parity | bench | all; several run in turn
#   bash scripts/gpu_validate.sh lease [--deadline S] [--parts P,..]
#       # the one-command plan for a short lease (benchmarks/gpu/lease.py, docs/gpu.md)
#   bash scripts/gpu_validate.sh --assemble-only
#
# GPU_DIR (default .gpu/ in the repository) holds what this call brought: wheels/,
# tokenizer/, project.tar.gz, manifest.txt and any of the model's chunks. GPU_CACHE (default
# /tmp/jaxllm-gpu) keeps across calls on the same machine: the installed wheels, the chunks
# seen so far, the tokenizer and the assembled model (a machine that restarts starts with none
# of them).
# Once every chunk in the manifest is there, the model is assembled and its sha256 checked.
# The stage runs with JAX_PLATFORMS=cuda (no CPU fallback: no GPU is a failure), unbuffered,
# writing its JSON into $OUT (default ./gpu_checks_out). Extra arguments go to
# benchmarks/gpu_checks.py.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPU_DIR="${GPU_DIR:-$ROOT/.gpu}"
GPU_CACHE="${GPU_CACHE:-/tmp/jaxllm-gpu}"
PYTHON="${PYTHON:-python3}"
STAGES=" probe kernels tiny realshape parity bench all lease "

die() { echo "gpu_validate.sh: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: gpu_validate.sh STAGE [STAGE ...] [gpu_checks.py options] | --assemble-only"
STAGE="$1"; shift
if [[ "$STAGE" != "--assemble-only" && "$STAGES" != *" $STAGE "* ]]; then
    die "unknown stage '$STAGE' (one of:$STAGES or --assemble-only)"
fi
RUN_STAGES=("$STAGE")
while [[ $# -gt 0 && "$1" != -* ]]; do
    [[ "$STAGES" == *" $1 "* ]] || die "unknown stage '$1' (one of:$STAGES)"
    RUN_STAGES+=("$1"); shift
done
mkdir -p "$GPU_CACHE/chunks" "$GPU_CACHE/jaxllm/models"

# --------------------------------------------------------------------------- the model
# Chunks are checked against the manifest as they arrive; the file is assembled once all are
# here, into jaxllm's cache directory, where the engine finds the embedded model.
model_state() {
    local manifest="$GPU_CACHE/manifest.txt"
    [[ -f "$GPU_DIR/manifest.txt" ]] && cp "$GPU_DIR/manifest.txt" "$manifest"
    if [[ ! -f "$manifest" ]]; then
        echo "model: no manifest.txt brought yet"
        return 0
    fi
    local name sha size target missing=()
    read -r sha size name < <(tail -n 1 "$manifest")
    target="$GPU_CACHE/jaxllm/models/$name"
    if [[ -f "$target" && "$(stat -c %s "$target")" == "$size" ]]; then
        echo "model: $target (assembled earlier on this machine)"
        return 0
    fi
    while read -r csha csize cname; do
        local have="$GPU_CACHE/chunks/$cname"
        if [[ -f "$GPU_DIR/model/$cname" && ! -f "$have" ]]; then
            local got
            got=$(sha256sum "$GPU_DIR/model/$cname" | cut -d' ' -f1)
            [[ "$got" == "$csha" ]] || die "$cname: sha256 $got, manifest says $csha"
            cp "$GPU_DIR/model/$cname" "$have.tmp" && mv "$have.tmp" "$have"
        fi
        [[ -f "$have" ]] || missing+=("$cname")
    done < <(head -n -1 "$manifest")
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "model: waiting for ${#missing[@]} chunks: ${missing[*]}"
        return 0
    fi
    head -n -1 "$manifest" | while read -r _ _ cname; do cat "$GPU_CACHE/chunks/$cname"; done \
        > "$target.tmp"
    local got
    got=$(sha256sum "$target.tmp" | cut -d' ' -f1)
    if [[ "$got" != "$sha" ]]; then
        rm -f "$target.tmp"
        die "assembled $name has sha256 $got, manifest says $sha"
    fi
    mv "$target.tmp" "$target"
    rm -rf "$GPU_CACHE/chunks"
    echo "model: assembled $target ($size bytes, sha256 checked)"
}

model_state
if [[ "$STAGE" == "--assemble-only" ]]; then
    exit 0
fi

# --------------------------------------------------------------------------- packages
if compgen -G "$GPU_DIR/wheels/*.whl" > /dev/null; then
    stamp="$GPU_CACHE/site/.installed"
    wanted=$(cd "$GPU_DIR/wheels" && ls ./*.whl | sort | tr '\n' ' ')
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$GPU_CACHE/site" "$GPU_DIR"/wheels/*.whl
        echo "$wanted" > "$stamp"
    fi
fi
[[ -d "$GPU_CACHE/site" ]] && export PYTHONPATH="$GPU_CACHE/site${PYTHONPATH:+:$PYTHONPATH}"

# --------------------------------------------------------------------------- the project
PROJECT="$ROOT"
if [[ ! -f "$PROJECT/benchmarks/gpu_checks.py" ]]; then
    [[ -f "$GPU_DIR/project.tar.gz" ]] || die "no project here and no $GPU_DIR/project.tar.gz"
    PROJECT="$GPU_CACHE/project"
    # A fresh copy: files deleted from the project since an earlier call must not linger.
    rm -rf "$PROJECT"
    mkdir -p "$PROJECT"
    tar -xzf "$GPU_DIR/project.tar.gz" -C "$PROJECT"
fi
export PYTHONPATH="$PROJECT${PYTHONPATH:+:$PYTHONPATH}"
# The tokenizer comes with the first call; later calls find the machine's copy.
if [[ -d "$GPU_DIR/tokenizer" ]]; then
    rm -rf "$GPU_CACHE/tokenizer"
    cp -r "$GPU_DIR/tokenizer" "$GPU_CACHE/tokenizer"
fi
[[ -d "$GPU_CACHE/tokenizer" ]] && export JAXLLM_GPU_TOKENIZER="$GPU_CACHE/tokenizer"

# --------------------------------------------------------------------------- the stage
export JAXLLM_CACHE_DIR="$GPU_CACHE/jaxllm"
export JAX_PLATFORMS=cuda
export PYTHONUNBUFFERED=1
"$PYTHON" -c "import jax, sys; b = jax.default_backend(); sys.exit(0 if b == 'gpu' else \
f'gpu_validate.sh: JAX runs on {b}, not a GPU ({jax.devices()})')"
if [[ " ${RUN_STAGES[*]} " == *" parity "* || " ${RUN_STAGES[*]} " == *" all "* ]]; then
    [[ -f "$GPU_CACHE/manifest.txt" ]] || die "parity needs the model: bring manifest.txt"
    read -r _ size name < <(tail -n 1 "$GPU_CACHE/manifest.txt")
    [[ -f "$JAXLLM_CACHE_DIR/models/$name" ]] || die "parity needs the model: chunks missing"
fi
OUT_DIR="${OUT:-$PWD/gpu_checks_out}"
cd "$PROJECT"
exec "$PYTHON" benchmarks/gpu_checks.py "${RUN_STAGES[@]}" --out "$OUT_DIR" "$@"
