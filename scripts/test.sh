#!/usr/bin/env bash
# Set everything up (if needed), then run the whole test suite on the real model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
