#!/usr/bin/env bash
# Optional: vLLM's `suffix` method (Arctic Inference) for benchmarks/acceptance.py. Its build
# asks for torch>=2.10, so pin the torch already installed to keep pip from fetching a CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
constraint="$(mktemp)"
.venv/bin/python -c "import torch; print('torch==' + torch.__version__)" > "$constraint"
PIP_CONSTRAINT="$constraint" .venv/bin/python -m pip install -q --no-deps arctic-inference==0.3.0
rm -f "$constraint"
