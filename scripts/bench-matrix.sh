#!/usr/bin/env bash
# The benchmark matrix of the README's headline tables, one `vllm-tokenswift bench`
# invocation per block, each with its own AR baseline, runs interleaved round by round
# (--interleave). Results go to OUT/<block>/; merge the blocks that share no run with
# `vllm-tokenswift bench-report OUT/{2k,6k,b8,yarn-12k} --out DIR` (ablations-a and -b each have
# an AR run at 2K, as does 2k, so they keep their own reports).
#
# Usage: scripts/bench-matrix.sh [OUT] [BLOCK ...]
#   OUT     output folder (default docs/bench/smollm2/matrix)
#   BLOCK   any of: 2k 6k ablations b8 yarn tiny16k k16 (default: all, in this order), or
#           engines: the settings whose one-round verdicts were within a few percent, rerun on
#           fresh engine instances (--engines; not in the default list: ~3 h), or
#           tuning: the adaptive policy's tuning defaults against the earlier behaviour (~4 h), or
#           refresh: the headline table at one commit, policy=paper included (~7 h), or
#           refresh-yarn: only its YaRN 12K invocation, every peer (~2.1 h), or
#           policy-paper: the paper's policy beside AR at YaRN 12K, 6K and tiny 16K (~1.75 h), or
#           same-sampling: 2K under the paper's sampling and under paper-no-min-p, which every
#           method samples alike (ngram and suffix drop min_p under `paper`; ~35 min), or
#           noise: AR against a second AR engine (`ar2`), paired round by round under the paper's
#           sampling: the spread of a single round's ratio when both sides do the same work (~25 min), or
#           tables: no run; the README's tables from the finished folders (`vllm-tokenswift bench-table`)
#           into docs/bench/smollm2/current/{settings,same-sampling,noise}.md and .png
#
# Time on the 2-core CPU (AR about 15 tok/s at 2K context): 2k ~40 min, 6k ~65 min,
# ablations ~30 min, b8 ~40 min, yarn ~40 min, tiny16k ~25 min, k16 ~15 min; on the faster
# machine of 2026-11-26 (AR 22 tok/s at 6K): 6k 38, ablations 21, tiny16k 22, k16 4 min. Run nothing else meanwhile:
# every figure is a ratio to AR of the same round, but a second job still distorts them.
# Memory: --interleave keeps one engine per method (about 3 GB each for SmolLM2 with a
# 0.5 GiB KV cache), so a block holds at most 5 methods.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/bench/smollm2/matrix}
shift || true
BLOCKS=("$@")
[ ${#BLOCKS[@]} -eq 0 ] && BLOCKS=(2k 6k ablations b8 yarn tiny16k k16)
TS=.venv/bin/vllm-tokenswift
HEADS=$PWD/vllm_tokenswift/assets/smollm2-heads
PEERS=ar,tokenswift,ngram,ngram-best,suffix
# each setting's arguments, shared by its own block and by `refresh`
SET_2K=(--gen-lens 2048 --batch-sizes 1 --sampling greedy,paper --repeats 2 --prefix-len 2048 --kv-cache-gb 0.5)
SET_6K=(--gen-lens 6144 --batch-sizes 1 --sampling greedy,paper --repeats 1 --prefix-len 2048 --kv-cache-gb 0.5)
SET_B8=(--gen-lens 1024 --batch-sizes 8 --sampling greedy,paper --repeats 1 --prefix-len 2048 --kv-cache-gb 1.25)
SET_YARN=(--gen-lens 12288 --batch-sizes 1 --sampling paper --repeats 1 --prefix-len 2048 --yarn 2 --kv-cache-gb 0.75)
SET_TINY16K=(--model tiny --k 4 --gen-lens 16384 --batch-sizes 1 --sampling greedy,paper --repeats 1 --prefix-len 2048 \
             --kv-cache-gb 0.5)

# the tuning block's arms: TokenSwift with one policy_tuning switch turned back to its earlier value
arm() {  # arm NAME TUNING_JSON_MEMBERS: a --method-config value
  printf '%s={"method": "tokenswift", "model": "%s", "num_speculative_tokens": 8, "tokenswift": {"kv_budget": 1024, "policy_tuning": {%s}}}' \
    "$1" "$HEADS" "$2"
}
EXPLORE=$(arm tokenswift-explore '"explore_beside_ngram": true')
NOOBS=$(arm tokenswift-noobs '"observe_past_cut": false')
NOESC=$(arm tokenswift-noesc '"ngram_escape": false')

run() {  # run NAME ARGS...: one invocation unless its results are already there
  local name=$1; shift
  if [ -f "$OUT/$name/results.json" ] && [ -f "$OUT/$name/summary.md" ]; then
    echo "== $name: already done ($OUT/$name)"; return 0
  fi
  echo "== $name: $(date -u +%H:%M:%S) vllm-tokenswift bench $*"
  "$TS" bench --interleave --out "$OUT/$name" "$@"
}

# The refresh block's YaRN 12K invocation, every peer (~2.1 h; also a block of its own).
refresh_yarn() { run refresh-yarn-12k --methods "$PEERS" "${SET_YARN[@]}"; }
# The paper's policy (policy: "paper") beside AR at the longer settings, without the peers: the
# status table's last column (~1.75 h; also run by the refresh block). Longest first (~50 min),
# then 6K (~35 min) and tiny 16K (~20 min).
policy_paper() {
    run policy-paper-yarn-12k --methods ar,tokenswift-paper "${SET_YARN[@]}"
    run policy-paper-6k --methods ar,tokenswift-paper "${SET_6K[@]}"
    run policy-paper-tiny-16k --methods ar,tokenswift-paper "${SET_TINY16K[@]}"
}

# The README's tables: every setting at one package version (the refresh and policy-paper
# invocations), the same-sampling rounds and the AR-against-AR rounds.
tables() {
    local cur=docs/bench/smollm2/current
    "$TS" bench-table "$OUT"/refresh-{2k,6k,b8,b8-paper-engines,b8-paper-policy,yarn-12k} \
        "$OUT"/policy-paper-{6k,yarn-12k} "$OUT"/refresh-tiny-16k "$OUT"/policy-paper-tiny-16k \
        --out $cur/settings.md --png $cur/settings.png
    "$TS" bench-table "$OUT"/2k-paper-no-min-p "$OUT"/2k-no-min-p-quick \
        --out $cur/same-sampling.md --png $cur/same-sampling.png
    "$TS" bench-table "$OUT"/noise-ar-vs-ar --methods ar2 --focus ar2 --peers ar2 --out $cur/noise.md
}

for b in "${BLOCKS[@]}"; do
  case "$b" in
    2k) run 2k --methods "$PEERS" "${SET_2K[@]}" ;;
    6k) run 6k --methods "$PEERS" "${SET_6K[@]}" ;;
    ablations)
        run ablations-a --methods ar,tokenswift-paper,tokenswift-noheads,tokenswift-nofused \
            --gen-lens 2048 --batch-sizes 1 --sampling greedy,paper --repeats 1 --prefix-len 2048 \
            --kv-cache-gb 0.5
        run ablations-b --methods ar,tokenswift-k0,tokenswift-fullkv,tokenswift-static \
            --gen-lens 2048 --batch-sizes 1 --sampling greedy,paper --repeats 1 --prefix-len 2048 \
            --kv-cache-gb 0.5 ;;
    b8) run b8 --methods "$PEERS" "${SET_B8[@]}" ;;
    yarn) run yarn-12k --methods ar,tokenswift "${SET_YARN[@]}" ;;
    tiny16k) run tiny-16k --methods ar,tokenswift,ngram,suffix "${SET_TINY16K[@]}" ;;
    engines)
        run 6k-greedy-engines --engines 3 --methods ar,tokenswift,suffix --gen-lens 6144 --batch-sizes 1 \
            --sampling greedy --repeats 1 --prefix-len 2048 --kv-cache-gb 0.5
        run b8-paper-engines2 --engines 2 --methods ar,tokenswift,ngram --gen-lens 1024 --batch-sizes 8 \
            --sampling paper --repeats 1 --prefix-len 2048 --kv-cache-gb 1.25
        run 6k-paper-engines --engines 2 --methods ar,tokenswift,ngram --gen-lens 6144 --batch-sizes 1 \
            --sampling paper --repeats 1 --prefix-len 2048 --kv-cache-gb 0.5
        run tiny-16k-greedy-engines --engines 2 --model tiny --k 4 --methods ar,tokenswift,suffix \
            --gen-lens 16384 --batch-sizes 1 --sampling greedy --repeats 1 --prefix-len 2048 --kv-cache-gb 0.5
        run 2k-greedy-engines --engines 2 --methods ar,tokenswift,suffix --gen-lens 2048 --batch-sizes 1 \
            --sampling greedy --repeats 1 --prefix-len 2048 --kv-cache-gb 0.5 ;;
    tuning)   # the policy_tuning defaults against the earlier behaviour, on fresh instances (~30 min each)
        # (a later --sampling/--repeats overrides the SET_* one)
        run 6k-greedy-explore-ab --engines 2 --methods ar,tokenswift,tokenswift-explore,suffix \
            --method-config "$EXPLORE" "${SET_6K[@]}" --sampling greedy
        run b8-paper-engines3 --engines 2 --methods ar,tokenswift,ngram "${SET_B8[@]}" --sampling paper
        run b8-greedy-observe-ab --engines 2 --methods ar,tokenswift,tokenswift-noobs,suffix \
            --method-config "$NOOBS" "${SET_B8[@]}" --sampling greedy
        run 2k-paper-observe-ab --methods ar,tokenswift,tokenswift-noobs --method-config "$NOOBS" \
            "${SET_2K[@]}" --sampling paper
        run b8-paper-observe-ab --methods ar,tokenswift,tokenswift-noobs --method-config "$NOOBS" \
            "${SET_B8[@]}" --sampling paper
        run 2k-greedy-escape-ab --engines 2 --methods ar,tokenswift,tokenswift-noesc,suffix \
            --method-config "$NOESC" "${SET_2K[@]}" --sampling greedy --repeats 1
        run 2k-paper-escape-ab --methods ar,tokenswift,tokenswift-noesc --method-config "$NOESC" \
            "${SET_2K[@]}" --sampling paper
        run b8-greedy-escape-ab --engines 2 --methods ar,tokenswift,tokenswift-noesc,suffix \
            --method-config "$NOESC" "${SET_B8[@]}" --sampling greedy
        run b8-paper-escape-ab --methods ar,tokenswift,tokenswift-noesc --method-config "$NOESC" \
            "${SET_B8[@]}" --sampling paper
        run 6k-paper-escape-ab --methods ar,tokenswift,tokenswift-noesc --method-config "$NOESC" \
            "${SET_6K[@]}" --sampling paper ;;
    refresh)  # the headline table again at one commit, with the paper's policy beside the adaptive one
        # (~6 h in all; a block holds 6 engines at a 0.5 GiB KV cache, 5 at batch 8's 1.25 GiB)
        run refresh-2k --methods "$PEERS,tokenswift-paper" "${SET_2K[@]}"
        run refresh-b8 --methods "$PEERS" "${SET_B8[@]}"
        # refresh-b8's paper miss, on fresh engines (the later --sampling overrides SET_B8's)
        run refresh-b8-paper-recheck --methods ar,tokenswift,ngram-best "${SET_B8[@]}" --sampling paper
        # and every peer on 2 fresh instances: one instance's round at batch 8 is not enough
        run refresh-b8-paper-engines --methods "$PEERS" "${SET_B8[@]}" --sampling paper --engines 2
        run refresh-b8-paper-policy --methods ar,tokenswift-paper "${SET_B8[@]}"
        # the longer settings with every peer (5 engines each), and the paper's policy beside its
        # own AR in the policy-paper block's invocations (kept apart so no invocation holds 6 engines)
        run refresh-6k --methods "$PEERS" "${SET_6K[@]}"
        refresh_yarn
        run refresh-tiny-16k --methods "$PEERS" "${SET_TINY16K[@]}"
        policy_paper ;;
    refresh-yarn) refresh_yarn ;;
    same-sampling) run 2k-paper-no-min-p --methods ar,tokenswift,ngram,ngram-best "${SET_2K[@]}" \
            --sampling paper,paper-no-min-p --repeats 1 ;;
    policy-paper) policy_paper ;;
    tables) tables ;;
    noise) run noise-ar-vs-ar --methods ar,ar2 --method-config 'ar2=null' --gen-lens 1024 --batch-sizes 1 \
            --sampling paper --repeats 5 --prefix-len 2048 --kv-cache-gb 0.5 ;;
    k16) run k16-2k --k 16 --methods ar,tokenswift,suffix-16 \
            --method-config 'suffix-16={"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_cached_requests": 0}' \
            --gen-lens 2048 --batch-sizes 1 --sampling greedy --repeats 2 --prefix-len 2048 --kv-cache-gb 0.5 ;;
    *) echo "unknown block $b" >&2; exit 2 ;;
  esac
done
echo "== done $(date -u +%H:%M:%S)"
