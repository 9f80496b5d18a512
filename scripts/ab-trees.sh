#!/usr/bin/env bash
# Greedy A/B of two source trees in one invocation (issue 57: the restructure must leave
# TokenSwift's output and speed as they were). Each round runs the same benchmark once per
# tree, alternating, each in its own process with PYTHONPATH pointing at that tree (vLLM's
# worker processes inherit it, and the plugin's entry point resolves there).
#   BEFORE=/tmp/ab-before AFTER=$PWD [FIRST=N] bash scripts/ab-trees.sh smollm2-2k|tiny-32k [ROUNDS]
# Writes OUT/<block>/<tree>-r<round>/ (bench results with saved tokens) and prints the
# per-round ratios after/before with token identity (scripts/ab-trees-report.py).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:?set BEFORE to the other tree (git worktree add /tmp/ab-before COMMIT)}
AFTER=${AFTER:-$PWD}
OUT=${OUT:-docs/bench/restructure-ab}
PY=${PY:-.venv/bin/python}
block=$1
rounds=${2:-2}
first=${FIRST:-1}
case "$block" in
  smollm2-2k) ARGS=(--model smollm2 --gen-lens 2048 --batch-sizes 1) ;;
  tiny-32k) ARGS=(--model tiny --yarn 5 --book 28054 --prefix-len 32768 --gen-lens 1024
                  --engine-arg enable_prefix_caching=true --kv-cache-gb 1.5) ;;
  *) echo "unknown block $block" >&2; exit 2 ;;
esac
for r in $(seq "$first" "$((first + rounds - 1))"); do
  for tree in before after; do
    dir=$BEFORE; [ "$tree" = after ] && dir=$AFTER
    echo "== $block round $r: $tree ($dir) $(date -u +%H:%M)"
    PYTHONPATH=$dir "$PY" -m vllm_tokenswift.cli bench "${ARGS[@]}" --methods tokenswift --sampling greedy \
      --repeats 1 --save-tokens --quiet --out "$OUT/$block/$tree-r$r" > "$OUT/$block/$tree-r$r.log" 2>&1 \
      || { echo "failed: see $OUT/$block/$tree-r$r.log" >&2; exit 1; }
  done
done
"$PY" scripts/ab-trees-report.py "$OUT/$block"
