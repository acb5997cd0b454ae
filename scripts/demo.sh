#!/usr/bin/env bash
# The main job: set everything up, then serve SmolLM2-135M-Instruct through vLLM's OpenAI
# server without and with our proposer, and compare answers, acceptance and speed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vllm-retrieval-spec demo "$@"
