#!/usr/bin/env bash
# Every number in BENCHMARKS.md: runs the workloads one after another (each in its own process,
# HF transformers in the same process as jaxllm), writing JSON and logs to benchmarks/results/
# and the plot to benchmarks/sweep.png. About 55 minutes on a 2-core CPU; nothing else should
# run meanwhile. Usage: bash benchmarks/run_all.sh [a|b|c|profile|sweep|shapes ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure_venv.sh
OUT=benchmarks/results
mkdir -p "$OUT"
BENCH=(.venv/bin/jaxllm bench)
run() {  # name, command...
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  /usr/bin/time -v "$@" --output-json "$OUT/$name.json" --no-progress 2>&1 | tee -a "$OUT/$name.log"
}
want() { [[ $# -eq 0 ]] || [[ " ${SELECTED[*]} " == *" $1 "* ]]; }
SELECTED=("$@")
{
  date -u; uname -srm; lscpu | grep -E 'Model name|^CPU\(s\)|L3'
  .venv/bin/python -c 'import jax, torch, transformers; print("jax", jax.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
} > "$OUT/machine.txt"
if [[ ${#SELECTED[@]} -eq 0 ]] || want a; then
  run a_uniform_64x128x128 "${BENCH[@]}" throughput --num-prompts 64 --input-len 128 \
    --output-len 128 --ignore-eos --compare-hf --hf-batch-size 64
fi
if [[ ${#SELECTED[@]} -eq 0 ]] || want b; then
  run b_latency_batch1_128x128 "${BENCH[@]}" latency --batch-size 1 --input-len 128 \
    --output-len 128 --num-iters 3 --num-iters-warmup 1 --compare-hf
fi
if [[ ${#SELECTED[@]} -eq 0 ]] || want c; then
  run c_ragged_64 "${BENCH[@]}" throughput --num-prompts 64 --random-input-range 16 512 \
    --random-output-range 16 256 --ignore-eos --compare-hf --hf-batch-size 64
fi
if [[ ${#SELECTED[@]} -eq 0 ]] || want profile; then
  # Its own run: --profile raises max_num_seqs to 256, which would change the workloads above.
  run profile_1_64_256 "${BENCH[@]}" latency --batch-size 1 --input-len 16 --output-len 4 \
    --num-iters 1 --num-iters-warmup 1 --no-roofline --profile --profile-batch-sizes 1 64 256 \
    --profile-input-len 64
fi
if [[ ${#SELECTED[@]} -eq 0 ]] || want sweep; then
  run sweep_128x64 "${BENCH[@]}" sweep --batch-sizes 1 2 4 8 16 32 64 --input-len 128 \
    --output-len 64 --compare-hf --output-png benchmarks/sweep.png
fi
if [[ ${#SELECTED[@]} -eq 0 ]] || want shapes; then
  # What XLA (and PyTorch, for HF) reach on the model's own matmul shapes: explains the gaps.
  .venv/bin/python benchmarks/gemm_rows.py --torch 1 4 16 64 256 512 | tee "$OUT/gemm_rows.txt"
  .venv/bin/python benchmarks/gemv_shapes.py | tee "$OUT/gemv_shapes.txt"
fi
