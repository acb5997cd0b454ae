#!/usr/bin/env bash
# The GPU checks of docs/gpu-checklist (run on a CUDA machine without vLLM: kernels only).
#
#   scripts/gpu_check.sh build tests sanitize   # build for sm_90, CUDA tests, compute-sanitizer
#   scripts/gpu_check.sh build bench            # kernel, tree-attention and verification-cost benchmarks
#   scripts/gpu_check.sh build tests sanitize bench pack   # all of it, then one archive of the logs
#
# Logs go to $OUT (default: benchmarks/results/gpu); benchmark JSON to benchmarks/results/ (and $OUT).
# The extension is built with CMake straight into vllm_retrieval_spec/ (no pip install: the
# package runs from the checkout, so vLLM and faiss are not needed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
ARCH=${CUDA_ARCH:-90}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
TESTS=(tests/test_tree_kernels.py tests/test_context_ngram_kernel.py tests/test_tree_attention.py)
status=0

build() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
  nvcc --version | tail -2 | tee -a "$OUT/device.txt"
  "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/device.txt"
  local dir=/tmp/vrs-cuda-build
  cmake -S csrc -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" >"$OUT/build.log" 2>&1 &&
    cmake --build "$dir" --target _C >>"$OUT/build.log" 2>&1 &&
    cp "$dir"/_C*.so vllm_retrieval_spec/ ||
    { tail -30 "$OUT/build.log"; exit 1; }
  "$PYTHON" -c "from vllm_retrieval_spec.kernels import extension_backends as b; print('backends', b())" |
    tee -a "$OUT/device.txt"
}

tests() {
  "$PYTHON" -m pytest -q -p no:cacheprovider -rs --junitxml="$OUT/tests.xml" "${TESTS[@]}" 2>&1 |
    tee "$OUT/tests.log" | tail -15 || status=1
}

# The 24-request long-context attention cases take minutes under the sanitizers (their reference
# runs on the host); the smaller ones cover the split path, the plain tests the unsplit one.
sanitize() {
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$PYTHON" -m pytest -q -p no:cacheprovider -x -k "cuda and not 1-32-24" "${TESTS[@]}" \
      >"$OUT/sanitize_$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $?"
    grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize_$tool.log" | tail -3
  done
}

bench() {
  "$PYTHON" benchmarks/kernels.py --device cuda --batches 1 8 64 256 2>&1 | tee "$OUT/kernels.log" | tail -40
  "$PYTHON" benchmarks/tree_attention.py --device cuda --trees 1 8 64 256 --contexts 1000 4000 2>&1 |
    tee "$OUT/tree_attention.log"
  "$PYTHON" benchmarks/verify_cost.py 2>&1 | tee "$OUT/verify_cost.log" | tail -25
  cp benchmarks/results/kernels_cuda.json benchmarks/results/tree_attention_cuda.json \
    benchmarks/results/verify_cost_*.json "$OUT"/ 2>/dev/null
}

# Everything under $OUT in one archive beside it (for machines that hand back only a few files).
pack() {
  tar czf "$OUT.tgz" -C "$OUT" . && echo "packed: $OUT.tgz"
}

for stage in "$@"; do
  "$stage"
done
exit $status
