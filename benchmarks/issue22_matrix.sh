#!/usr/bin/env bash
# The four workloads at 1 and 8 requests in flight and chat HumanEval at 32: no speculation,
# vLLM suffix (default: K = 24, its tree depth; K = 8; K = 32, REST's recommended K) and REST at
# K = 32, every config of a row in one interleaved run (engines built together, prompt groups run
# on each in balanced orders). Needs scripts/install-comparators.sh (arctic-inference) for suffix.
# ~75 minutes on 2 cores.
#
#   bash benchmarks/issue22_matrix.sh [TAG]     # results/acceptance_<workload>_..._<TAG>.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TAG=${1:-issue22}
CONFIGS=(none suffix suffix_k8 suffix_k32 rest_k32)
run() {  # prompt source..., then: concurrency, prompts, max tokens
  local args=("${@:1:$#-3}") rest=("${@: -3}")
  "$PY" benchmarks/acceptance.py "${args[@]}" --concurrency "${rest[0]}" --prompts "${rest[1]}" \
    --max-tokens "${rest[2]}" --interleave --tag "$TAG" --configs "${CONFIGS[@]}"
}
for workload in code_edit multi_turn doc_qa; do
  run --dataset "benchmarks/data/$workload.jsonl" 1 10 128
  run --dataset "benchmarks/data/$workload.jsonl" 8 24 128
done
run --form chat 1 20 64
run --form chat 8 32 64
run --form chat 32 64 64
