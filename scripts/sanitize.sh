#!/usr/bin/env bash
# Builds the C++ extension with AddressSanitizer and UndefinedBehaviorSanitizer into
# build/sanitize (CPU backend only; the editable install in .venv is left alone) and runs the
# fuzz test of everything read from disk and the kernel property tests against it. Any
# sanitizer report aborts the run (non-zero exit). Needs `bash scripts/setup.sh` first.
#
#   bash scripts/sanitize.sh                       # VRS_FUZZ_EXAMPLES=1000 per artifact kind
#   VRS_FUZZ_EXAMPLES=5000 bash scripts/sanitize.sh tests/test_fuzz_artifacts.py   # other tests/args
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=build/sanitize
PYTHON=.venv/bin/python
SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
TESTS=(tests/test_fuzz_artifacts.py tests/test_store_checks.py tests/test_rest_kernel.py
       tests/test_context_ngram_kernel.py tests/test_kernel_drafts.py tests/test_tree_kernels.py
       tests/test_chain_choice.py)

echo "sanitize: building the extension with ASan/UBSan into $BUILD"
cmake -S csrc -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DVRS_CUDA=OFF \
  -DPython_EXECUTABLE="$PWD/$PYTHON" -DCMAKE_CXX_FLAGS="$SANITIZE" \
  -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build "$BUILD" --target _C  # not the stubs: stubgen would import it without the ASan runtime

# The package as imported under the sanitizer: links to the sources, next to the sanitized _C.
package="$BUILD/python/vllm_retrieval_spec"
rm -rf "$BUILD/python" && mkdir -p "$package"
for entry in "$PWD"/vllm_retrieval_spec/*; do
  case "$(basename "$entry")" in __pycache__ | *.so | *.pyi) ;; *) ln -s "$entry" "$package/" ;; esac
done
ln -s "$PWD/$BUILD"/_C.*.so "$package/"

# The editable install's import hook would load the regular _C; it steps aside for its build dir.
editable_build="$("$PYTHON" -c 'import sys; print(next((getattr(f, "path", "") or "" for f in sys.meta_path
    if type(f).__name__ == "ScikitBuildRedirectingFinder"), ""))')"
export SKBUILD_EDITABLE_SKIP="$editable_build"
export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
# The ASan runtime must load first (python is not instrumented), and libstdc++ with it: ASan
# intercepts C++ throws only when libstdc++ is there at start-up.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
# Reports go to files (pytest captures stderr, and an abort loses what it captured).
reports="$PWD/$BUILD/reports"
rm -rf "$reports" && mkdir -p "$reports"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:detect_stack_use_after_return=1:log_path=$reports/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports/ubsan"
export VRS_FUZZ_EXAMPLES="${VRS_FUZZ_EXAMPLES:-1000}"

# (run outside the repository, whose own package would come first on sys.path)
(cd "$BUILD" && "$OLDPWD/$PYTHON" -c 'import vllm_retrieval_spec._C as c; assert "/build/sanitize/" in c.__file__, c.__file__
print("sanitize: testing against", c.__file__)')

# pytest's script, not `python -m pytest`, which would put the repository's own package (no _C) first on sys.path.
(( $# > 0 )) || set -- "${TESTS[@]}"
status=0
.venv/bin/pytest -q -p no:cacheprovider "$@" || status=$?
if compgen -G "$reports/*" >/dev/null; then
  echo "sanitize: sanitizer reports:" >&2
  cat "$reports"/* >&2
  status=1
fi
echo "sanitize: $( ((status == 0)) && echo "no sanitizer reports, tests passed" || echo "FAILED (exit $status)")"
exit "$status"
