#!/usr/bin/env bash
# One command for the main job: set up (or reuse) .venv and the SmolLM2-135M-Instruct model,
# then run the TokenSwift demo: SmolLM2 + its heads on a book opening, plain decoding vs
# TokenSwift under greedy decoding and under the paper's sampling (1,024 tokens per run).
# vLLM's own log lines go to a file (its path is printed); --verbose shows them.
# Extra arguments go to `vllm-tokenswift demo` (e.g. --max-tokens 2048, --model tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_ARGS=()
DEMO_ARGS=()
for a in "$@"; do
  case "$a" in --cpu|--cuda) SETUP_ARGS+=("$a") ;; *) DEMO_ARGS+=("$a") ;; esac
done
bash scripts/setup.sh "${SETUP_ARGS[@]}"
exec .venv/bin/vllm-tokenswift demo "${DEMO_ARGS[@]}"
