#!/usr/bin/env bash
# One command for the main job: set up (or reuse) .venv, then run the TokenSwift demo on the
# bundled model, heads and book prompt (plain decoding vs TokenSwift, 4,096 tokens).
# Extra arguments go to `vllm-tokenswift demo` (e.g. --max-tokens 8192).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ARGS=()
DEMO_ARGS=()
for a in "$@"; do
  case "$a" in --cpu|--cuda) SETUP_ARGS+=("$a") ;; *) DEMO_ARGS+=("$a") ;; esac
done
bash scripts/setup.sh "${SETUP_ARGS[@]}"
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
exec .venv/bin/vllm-tokenswift demo "${DEMO_ARGS[@]}"
