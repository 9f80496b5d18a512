#!/usr/bin/env bash
# One command for the test suite: set up (or reuse) .venv with the test extras, then run pytest.
#   ./scripts/test.sh            the full suite (what CI runs); prints the 15 slowest tests
#   ./scripts/test.sh --fast     engine-free tests only (-m "not engine"), for the development loop
# Both run two pytest-xdist workers (TOKENSWIFT_TEST_WORKERS=N to change, 0 for none).
# Extra arguments go to pytest (e.g. -k ngram). Exit code: pytest's, except that
# "no tests collected" (5) counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ARGS=(--test)
PYTEST_ARGS=()
FAST=0
for a in "$@"; do
  case "$a" in
    --cpu|--cuda) SETUP_ARGS+=("$a") ;;
    --fast) FAST=1 ;;
    *) PYTEST_ARGS+=("$a") ;;
  esac
done
# two workers (pytest-xdist), a test file per worker at a time (its module fixtures stay
# together), files handed out in collection order (tests/conftest.py puts the slowest
# first; xdist's default reorder by test count would leave them for last);
# TOKENSWIFT_TEST_WORKERS=0 runs everything in this process
WORKERS=${TOKENSWIFT_TEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != 0 ]; then XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder); fi
if [ "$FAST" = 1 ]; then
  PYTEST_ARGS=("${XDIST[@]}" -m "not engine" "${PYTEST_ARGS[@]}")
else
  PYTEST_ARGS=("${XDIST[@]}" --durations=15 "${PYTEST_ARGS[@]}")
fi
bash scripts/setup.sh "${SETUP_ARGS[@]}"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
set +e
.venv/bin/python -m pytest "${PYTEST_ARGS[@]}"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
