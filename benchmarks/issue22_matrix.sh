#!/usr/bin/env bash
# The four workloads at 1, 8 and 32 requests in flight: no speculation (first and last), vLLM
# suffix (default, K = 24 = its tree depth, and K = 8), REST at K = 8 and K = 32, one run per
# row. Needs scripts/install-comparators.sh (arctic-inference) for suffix. ~45 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CONFIGS=(none suffix suffix_k8 rest_k8 rest_k32)
run() {  # workload, concurrency, prompts, max tokens
  "$PY" benchmarks/acceptance.py --dataset "benchmarks/data/$1.jsonl" --concurrency "$2" --prompts "$3" \
    --max-tokens "$4" --tag issue22 --configs "${CONFIGS[@]}"
}
for workload in code_edit multi_turn doc_qa humaneval_chat; do
  tokens=$([[ $workload == code_edit || $workload == multi_turn ]] && echo 128 || echo 64)
  run "$workload" 1 10 "$tokens"
  run "$workload" 8 24 "$tokens"
done
run code_edit 32 64 128
run humaneval_chat 32 64 64
