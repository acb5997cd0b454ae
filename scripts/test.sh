#!/usr/bin/env bash
# Set everything up (if needed), then run the whole test suite on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two pytest-xdist workers, each on its own share of the cores (tests/workers.py); VRS_TEST_WORKERS=1 runs one.
workers="${VRS_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
parallel=()
if (( workers > 1 )); then parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
exec .venv/bin/python -m pytest "${parallel[@]}" "$@"
