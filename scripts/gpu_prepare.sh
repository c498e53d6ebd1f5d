#!/usr/bin/env bash
# Build what a GPU machine with no package registry needs to run the GPU checks
# (docs/gpu.md), on a machine that has one:
#
#   [PYTHON=python-with-jaxllm-deps] bash scripts/gpu_prepare.sh [DEST] [--no-wheels] [--wheel-cache DIR] [--serve]
#                               [--model FILE] [--no-tokenizer] [--no-model]
#                               [--carry-limit-bytes N] [--chunk-bytes N] [--first-chunk-bytes N]
#
# DEST (default .gpu/ in the repository, ignored by git) gets:
#   wheels/        Python 3.12 manylinux x86_64 wheels of the runtime packages the GPU image
#                  lacks (with --serve also the server's and the OpenAI client's, not yet
#                  tried on the GPU image); --wheel-cache DIR takes them from DIR
#                  (offline), --no-wheels makes none
#   tokenizer/     the model's tokenizer converted from its GGUF (--no-tokenizer: none)
#   project.tar.gz the project at HEAD (git archive)
#   model/chunk-NN the model file (default: the embedded GGUF; --model FILE or
#                  $JAXLLM_GPU_MODEL another) in pieces that each travel beside the working tree
#                  under the carry limit (64 MiB) with the wheels; the first is smaller, as the
#                  tokenizer travels with it
#   manifest.txt   "sha256 size name" of every chunk, then of the whole file (its name last)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
DEST=""
WHEELS=1
WHEEL_CACHE=""
SERVE=0
MODEL="${JAXLLM_GPU_MODEL:-}"
TOKENIZER=1
WITH_MODEL=1
CARRY_LIMIT=$((64 << 20))
CHUNK=""
FIRST_CHUNK=""

die() { echo "gpu_prepare.sh: $*" >&2; exit 2; }
need_int() { [[ "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || die "$1 needs a positive byte count, got '$2'"; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-wheels) WHEELS=0 ;;
        --wheel-cache) [[ $# -ge 2 ]] || die "--wheel-cache needs a directory"
                       WHEEL_CACHE="$2"; shift ;;
        --serve) SERVE=1 ;;
        --model) [[ $# -ge 2 ]] || die "--model needs a file"; MODEL="$2"; shift ;;
        --no-tokenizer) TOKENIZER=0 ;;
        --no-model) WITH_MODEL=0 ;;
        --carry-limit-bytes) need_int "$1" "${2:-}"; CARRY_LIMIT="$2"; shift ;;
        --chunk-bytes) need_int "$1" "${2:-}"; CHUNK="$2"; shift ;;
        --first-chunk-bytes) need_int "$1" "${2:-}"; FIRST_CHUNK="$2"; shift ;;
        -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$DEST" ]] || die "one DEST only, got '$DEST' and '$1'"; DEST="$1" ;;
    esac
    shift
done
DEST="${DEST:-$ROOT/.gpu}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
[[ -z "$WHEEL_CACHE" || -d "$WHEEL_CACHE" ]] || die "--wheel-cache $WHEEL_CACHE is not a directory"

# --------------------------------------------------------------------------- wheels
# What the GPU image (Python 3.12, JAX 0.11.2 with the CUDA 13 plugin) holds of jaxllm's runtime
# dependencies, and wheels of the others. Versions: the ones this project is tested with (a
# test holds every runtime dependency in pyproject.toml to one of the two lists; the script
# itself does not read the first).
# shellcheck disable=SC2034
# huggingface_hub comes with transformers; its version there is not checked: the GPU machine
# reaches no network, so no Hub id is fetched on it.
GPU_IMAGE_HAS=(jax jaxlib torch transformers flax jinja2 tokenizers safetensors numpy tqdm
               pyyaml requests prometheus-client huggingface-hub)
RUNTIME_WHEELS=(msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0 llguidance==1.9.1)
# `jaxllm serve` and `jaxllm bench serve`: with --serve only. Their wheels' Requires-Dist,
# closed over, less what the image's package list names (anyio, annotated-doc, click, h11,
# idna, typing-extensions): the image's versions of those are not checked against the lower
# bounds here, and this set has not run on the GPU image yet.
SERVE_WHEELS=(fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4
              starlette==1.10.0 annotated-types==0.8.0 typing-inspection==0.4.5
              opentelemetry-api==1.45.2 openai==3.54.0 jiter==0.19.0 sniffio==1.3.1
              httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5)

rm -rf "$DEST/wheels"
if [[ $WHEELS == 1 ]]; then
    mkdir -p "$DEST/wheels"
    wanted=("${RUNTIME_WHEELS[@]}")
    [[ $SERVE == 1 ]] && wanted+=("${SERVE_WHEELS[@]}")
    source_args=()
    [[ -n "$WHEEL_CACHE" ]] && source_args=(--no-index --find-links "$WHEEL_CACHE")
    # --no-deps: each needed package is named above; the platform tags are what pip matches
    # exactly for a manylinux x86_64 CPython 3.12 machine.
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 "${source_args[@]}" -d "$DEST/wheels" "${wanted[@]}" \
        || die "pip download failed for: ${wanted[*]}"
    echo "wheels: $(ls "$DEST/wheels" | tr '\n' ' ')"
fi

# --------------------------------------------------------------------------- project
rm -f "$DEST/project.tar.gz"
git -C "$ROOT" archive --format=tar.gz -o "$DEST/project.tar.gz" HEAD
echo "project: $DEST/project.tar.gz ($(git -C "$ROOT" rev-parse --short HEAD))"

# --------------------------------------------------------------------------- model
if [[ $WITH_MODEL == 0 ]]; then
    exit 0
fi
if [[ -z "$MODEL" ]]; then
    MODEL="$(cd "$ROOT" && PYTHONPATH="$ROOT" "$PYTHON" -c \
        'from jaxllm.model_executor.model_loader.default_model import default_model_path as p; print(p())')" \
        || die "could not find the embedded model with $PYTHON (set PYTHON to an interpreter with jaxllm's dependencies, or pass --model FILE)"
fi
[[ -f "$MODEL" ]] || die "model file $MODEL does not exist"

rm -rf "$DEST/tokenizer"
if [[ $TOKENIZER == 1 ]]; then
    # jaxllm converts a GGUF's vocabulary once and caches it under its cache directory
    # (model_loader/tokenizer.py); the GPU checks read this copy instead.
    (cd "$ROOT" && PYTHONPATH="$ROOT" "$PYTHON" -c '
import sys
from jaxllm.model_executor.model_loader.tokenizer import load_tokenizer
load_tokenizer(sys.argv[1]).save_pretrained(sys.argv[2])' "$MODEL" "$DEST/tokenizer") \
        || die "could not convert the tokenizer of $MODEL (--no-tokenizer skips it)"
fi

size_of() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
# What travels with every chunk: the working tree (tracked and untracked, not ignored files;
# a tracked file deleted from the tree travels not, and stat would fail on it).
TREE=$(cd "$ROOT" && git ls-files -co --exclude-standard -z \
       | while IFS= read -r -d '' f; do if [[ -e "$f" || -L "$f" ]]; then printf '%s\0' "$f"; fi; done \
       | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}')
SLACK=$((1 << 20))  # the manifest, directory entries
# Every call carries the wheels (a machine that restarted has lost them); the tokenizer comes
# once, with the first chunk.
WHEEL_BYTES=0
TOKENIZER_BYTES=0
[[ -d "$DEST/wheels" ]] && WHEEL_BYTES=$(size_of "$DEST/wheels")
[[ -d "$DEST/tokenizer" ]] && TOKENIZER_BYTES=$(size_of "$DEST/tokenizer")
CHUNK="${CHUNK:-$((CARRY_LIMIT - TREE - WHEEL_BYTES - SLACK))}"
FIRST_CHUNK="${FIRST_CHUNK:-$((CHUNK - TOKENIZER_BYTES))}"
[[ $FIRST_CHUNK -gt 0 && $CHUNK -gt 0 ]] \
    || die "no room for a chunk: carry limit $CARRY_LIMIT, tree $TREE, wheels $WHEEL_BYTES," \
           "tokenizer $TOKENIZER_BYTES bytes"

rm -rf "$DEST/model" "$DEST/manifest.txt"
mkdir -p "$DEST/model"
"$PYTHON" - "$MODEL" "$DEST" "$FIRST_CHUNK" "$CHUNK" <<'EOF'
import hashlib
import os
import sys

model, dest, first, rest = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lines, whole, index = [], hashlib.sha256(), 0
with open(model, "rb") as f:
    while data := f.read(first if index == 0 else rest):
        name = f"chunk-{index:02d}"
        with open(os.path.join(dest, "model", name), "wb") as out:
            out.write(data)
        whole.update(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()} {len(data)} {name}")
        index += 1
lines.append(f"{whole.hexdigest()} {os.path.getsize(model)} {os.path.basename(model)}")
with open(os.path.join(dest, "manifest.txt"), "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
echo "model: $MODEL in $(($(wc -l < "$DEST/manifest.txt") - 1)) chunks" \
     "(first $FIRST_CHUNK bytes, then $CHUNK; tree $TREE, wheels $WHEEL_BYTES," \
     "tokenizer $TOKENIZER_BYTES bytes)"
echo "manifest: $DEST/manifest.txt"
