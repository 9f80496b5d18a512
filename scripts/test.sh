#!/usr/bin/env bash
# One command for the test suite: set up (or reuse) .venv with the test extras, then run pytest.
# Extra arguments go to pytest (e.g. -k ngram). Exit code: pytest's, except that
# "no tests collected" (5) counts as a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ARGS=(--test)
PYTEST_ARGS=()
for a in "$@"; do
  case "$a" in --cpu|--cuda) SETUP_ARGS+=("$a") ;; *) PYTEST_ARGS+=("$a") ;; esac
done
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
