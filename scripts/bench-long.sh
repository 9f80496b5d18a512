#!/usr/bin/env bash
# The long-context measurements of docs/bench/long (the paper's length table on this CPU).
# Run each block alone on the machine (nothing else running), one at a time:
#   bash scripts/bench-long.sh BLOCK [BLOCK...]
# Blocks (minutes on the 2-vCPU box, mostly prefill: vLLM's CPU prefill of a 96K-token prefix took
# 9-10 minutes per engine on 2026-12-04 (37 on a slower day, 2026-12-02), about 1-4 at 32K):
#   probe          cost probe, demo model: decode / verify / draft-forward steps at 8K-96K (~200)
#   probe-32k      the probe at 32K only (kv_budget 512/1024/4096, both kernels)            (~20)
#   probe-16k      the probe at 16K, plugin kernel and plain vLLM, both samplings           (~10)
#   probe-96k      the probe at 96K only (kv_budget 1024, both kernels)                     (~80)
#   probe-64k-chains  the probe at 64K, the paper's sampling: plain vLLM, plain / verify 1-2 and
#                  self-speculative chain steps of 1 and 2 forwards (TriForce*) on the kernel,
#                  the draft forward over 1,024 tokens                                       (~20)
#   probe-smollm2  cost probe, SmolLM2 with YaRN x4 at 8K and 16K, the paper's sampling, both
#                  kernels and plain vLLM (12 min at 8K, 37 at 16K on 2026-12-04)          (~50)
#   context-8k context-32k context-64k context-96k
#                  demo model, YaRN x5, a prefix of The Brothers Karamazov (held out), 1,024
#                  tokens, greedy and the paper's sampling, 2 paired rounds; methods: plain
#                  vLLM (ar), plain decoding on the plugin's kernel (ar-vk), TokenSwift
#                  (adaptive), TokenSwift with the paper's drafting, the paper's TriForce* and
#                  Medusa* baselines, suffix and ngram, all but ar on the kernel
#                  (~40 / 80 / 110 / 160 with all eight methods; METHODS=... for fewer)
#   length         demo model, YaRN x2, 2K prefix, 32K tokens in one request, ar-vk /
#                  TokenSwift / TriForce* / suffix, both samplings, figures per 8K segment
#                  (three methods: 24 greedy, 32 paper's sampling on 2026-12-04)          (~80)
#   budget         demo model, 64K prefix: kv_budget 512 / 1024 / 4096 / full (the paper's
#                  Table 5), the paper's sampling                                            (~30)
#   budget-paper   the same with the paper's drafting (policy "paper": the draft forward every
#                  step), so each budget's acceptance is measured on every step            (~30)
#   budget-triforce  the same budgets with TriForce* (a self-speculative chain every step),
#                  giving the target's own per-position acceptance over each view          (~30)
#   smollm2-context  SmolLM2-135M and its heads, YaRN x4, a prefix of 8K and of 16K tokens of The
#                  Brothers Karamazov, 1,024 tokens, the paper's sampling (SAMPLINGS=...), 2 paired
#                  rounds; plain vLLM, ar-vk, TokenSwift, TriForce* (METHODS=...)         (~40)
#   smollm2        SmolLM2-135M, YaRN x4, 2K prefix, 16K tokens, AR / TokenSwift, both
#                  samplings, figures per 4K segment                                         (~80)
# Prefix caching is on, so a prefix is prefilled once per engine, not once per run; the
# decode-phase speedup (decode_speedup_vs_ar) is the figure that counts. Suffix decoding
# needs arctic-inference (recipe in vllm_tokenswift/bench/methods.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VT=.venv/bin/vllm-tokenswift
OUT=${OUT:-docs/bench/long}
BOOK=28054
COMMON=(--quiet --engine-arg enable_prefix_caching=true --kv-cache-gb 1.5)

# METHODS and REPEATS override the context blocks' methods and paired rounds (METHODS also
# the length block's; SAMPLINGS="paper" runs the context and length blocks for one sampling)
context() {   # context PREFIX_TOKENS NAME
  $VT bench --model tiny --yarn 5 --book $BOOK --prefix-len "$1" --gen-lens 1024 \
    --methods "${METHODS:-ar,ar-vk,tokenswift,tokenswift-paper,triforce,medusa,suffix-vk,ngram-vk}" \
    --sampling "${SAMPLINGS:-greedy,paper}" --interleave \
    --repeats "${REPEATS:-2}" \
    "${COMMON[@]}" --out "$OUT/$2"
}

for block in "$@"; do
  echo "== $block ($(date -u +%H:%M))"
  case "$block" in
    probe) $VT probe --model tiny --step-work --out "$OUT/probe-tiny" ;;
    probe-32k) $VT probe --model tiny --contexts 32768 --step-work --out "$OUT/probe-32k" ;;
    probe-16k)
      for s in greedy paper; do
        $VT probe --model tiny --contexts 16384 --drafts 0,2,4,8 --kv-budgets 1024 --kernels plugin,ar \
          --tokens 128 --sampling $s --out "$OUT/probe-16k-$s"
      done ;;
    probe-96k) $VT probe --model tiny --contexts 98304 --kv-budgets 1024 --out "$OUT/probe-96k" ;;
    probe-64k-chains) $VT probe --model tiny --contexts 65536 --drafts 0,1,2 --chains 1,2 --kv-budgets 1024 \
        --kernels plugin,ar --sampling paper --tokens 64 --no-micro --out "$OUT/probe-64k-chains" ;;
    probe-smollm2) $VT probe --model smollm2 --yarn 4 --contexts 8192,16384 --kernels plugin,vllm,ar \
        --sampling paper --out "$OUT/probe-smollm2" ;;
    context-8k) context 8192 context-8k ;;
    context-32k) context 32768 context-32k ;;
    context-64k) context 65536 context-64k ;;
    context-96k) context 98304 context-96k ;;
    length)   # one invocation per sampling (each ~25-35 min), so each lands on its own
      for s in ${SAMPLINGS:-greedy paper}; do
        $VT bench --model tiny --yarn 2 --book $BOOK --prefix-len 2048 --gen-lens 32768 \
          --methods "${METHODS:-ar-vk,tokenswift,triforce,suffix-vk}" --sampling $s --interleave --segment-tokens 8192 \
          "${COMMON[@]}" --out "$OUT/length-32k-$s"
      done ;;
    budget)
      $VT bench --model tiny --yarn 5 --book $BOOK --prefix-len 65536 --gen-lens 1024 \
        --methods ar,tokenswift-b512,tokenswift,tokenswift-b4096,tokenswift-fullkv --sampling paper \
        --interleave "${COMMON[@]}" --out "$OUT/budget-64k" ;;
    budget-paper)
      $VT bench --model tiny --yarn 5 --book $BOOK --prefix-len 65536 --gen-lens 1024 \
        --methods ar,tokenswift-b512,tokenswift,tokenswift-b4096,tokenswift-fullkv --sampling paper \
        --interleave --tokenswift '{"policy": "paper"}' "${COMMON[@]}" --out "$OUT/budget-64k-paper-policy" ;;
    budget-triforce)
      $VT bench --model tiny --yarn 5 --book $BOOK --prefix-len 65536 --gen-lens 1024 \
        --methods ar-vk,tokenswift-b512,tokenswift,tokenswift-b4096,tokenswift-fullkv --sampling paper \
        --interleave --tokenswift '{"policy": "triforce", "use_heads": false, "ngram_topk": 0, "chain_length": 2}' \
        "${COMMON[@]}" --out "$OUT/budget-64k-triforce" ;;
    smollm2-context)
      for n in 8192 16384; do
        $VT bench --model smollm2 --yarn 4 --book $BOOK --prefix-len $n --gen-lens 1024 \
          --methods "${METHODS:-ar,ar-vk,tokenswift,triforce}" --sampling "${SAMPLINGS:-paper}" --interleave \
          --repeats "${REPEATS:-2}" "${COMMON[@]}" --out "$OUT/smollm2-context-$((n / 1024))k"
      done ;;
    smollm2)
      $VT bench --model smollm2 --yarn 4 --prefix-len 2048 --gen-lens 16384 --methods ar,tokenswift \
        --sampling greedy,paper --interleave --segment-tokens 4096 "${COMMON[@]}" --out "$OUT/smollm2-16k" ;;
    *) echo "unknown block $block" >&2; exit 2 ;;
  esac
done
