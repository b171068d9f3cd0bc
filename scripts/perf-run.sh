#!/usr/bin/env bash
# The measurement run behind docs/performance.md's tables, in parts that each fit one
# device call (10 minutes): on a CUDA machine, after scripts/gpu-check.sh passed on the
# same binary. Every part writes its JSON, figure and log into $OUT.
#
#   BIN=target/release/pdserve OUT=perf scripts/perf-run.sh peer prefill decode ttft
#
#   peer      transformers' eager reference on the same GPU (scripts/peer_bench.py):
#             $OUT/peer.json, which prefill and decode read when it exists (PEER=FILE
#             to reuse one; PEER_ARGS="--decode-batch 1,8 ..." for fewer rows)
#   prefill   1K, 8K, 32K tokens in one forward and 128K in chunks of 16K, bf16 and fp8,
#             against the GEMM rate measured in the same run
#   prefill-deepseek  the stored formats' prefill under --numerics deepseek (FP8
#             activations; the FP8 linears on the block-scaled FP8 GEMM), fp8 KV, 1K/8K/32K
#   decode    batch 1..256, contexts 4K and 32K, bf16 and the stored formats, graphs and
#             eager, against the byte floor (WEIGHTS=bf16 for a shorter run)
#   ncu       one eager decode step of batch 1 and 64 (NCU_BATCH; NCU_WEIGHTS=fp8 for
#             the stored format; NCU_BATCH= for none) and one 8K prefill forward
#             (NCU_PREFILL; NCU_PREFILL_ARGS="--weights fp8 --numerics deepseek --kv-dtype
#             fp8" for the FP8 GEMMs) by kernel, through ncu and scripts/ncu_step.py
#   gap       the decode loop's host time between steps at batch 64 (embedded model)
#   ttft      an 8K prompt through router + prefill + decode (the bench's V4-Flash-dims
#             model, random weights: --load-format dummy) with the worker-side breakdown
#             (TTFT_REQUESTS=8 timed requests, one at a time)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/pdserve}
OUT=${OUT:-perf}
DEV=${DEV:-cuda:0}
# The bench's model (DIMS="--tiny" TTFT_TOKENS=512 DEV=cpu: a smoke test of this script).
read -r -a DIMS <<<"${DIMS:---layers 4 --experts 64}"
TTFT_TOKENS=${TTFT_TOKENS:-8192}
# Timed requests of the ttft part, one at a time (after one untimed).
TTFT_REQUESTS=${TTFT_REQUESTS:-8}
WEIGHTS=${WEIGHTS:-bf16,fp8,fp8-fp4}
NCU_BATCH=${NCU_BATCH-1,64}
NCU_WEIGHTS=${NCU_WEIGHTS:-bf16}
# Extra flags for every bench command (BENCH_ARGS="--no-pdl": plain kernel launches).
read -r -a BENCH_ARGS <<<"${BENCH_ARGS:-}"
NCU_PREFILL=${NCU_PREFILL:-8192}
read -r -a NCU_PREFILL_ARGS <<<"${NCU_PREFILL_ARGS:---weights bf16}"
[ -x "$BIN" ] || { echo "perf-run: $BIN not found: cargo build --release first (or set BIN)" >&2; exit 2; }
[ $# -gt 0 ] || { sed -n '2,23p' "$0"; exit 2; }
mkdir -p "$OUT"
work=$(mktemp -d)
# shellcheck source=scripts/cluster-lib.sh
source scripts/cluster-lib.sh
# shellcheck source=scripts/cuda-libs.sh
source scripts/cuda-libs.sh
cuda_libs perf-run
export PDSERVE_KERNEL_CACHE=${PDSERVE_KERNEL_CACHE:-$work/kernels}
trap 'stop_all; rm -rf "$work"' EXIT
PEER=${PEER:-$OUT/peer.json}
peer_flag() { [ -e "$PEER" ] && echo "--peer $PEER" || true; }

part_peer() {
  "$BIN" bench config "${DIMS[@]}" --out "$OUT/bench-config/config.json"
  # shellcheck disable=SC2086
  python3 scripts/peer_bench.py --config "$OUT/bench-config/config.json" --out "$PEER" ${PEER_ARGS:-}
}

part_prefill() {
  # shellcheck disable=SC2046
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens 1024,8192,32768 --weights bf16,fp8 \
    --repeats 3 --warmup 1 "${BENCH_ARGS[@]}" $(peer_flag) --json "$OUT/prefill.json" \
    --plot "$OUT/prefill.svg"
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens 131072 --chunk 16384 \
    --weights bf16,fp8 --repeats 1 --warmup 1 "${BENCH_ARGS[@]}" --json "$OUT/prefill-128k.json"
}

part_prefill_deepseek() {
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens 1024,8192,32768 --weights fp8,fp8-fp4 \
    --numerics deepseek --kv-dtype fp8 --repeats 3 --warmup 1 "${BENCH_ARGS[@]}" \
    --json "$OUT/prefill-deepseek.json"
}

part_decode() {
  # shellcheck disable=SC2046
  "$BIN" bench decode --device "$DEV" "${DIMS[@]}" --weights "$WEIGHTS" \
    --context 4096,32768 --graph capture,eager --steps 20 --warmup 3 "${BENCH_ARGS[@]}" \
    $(peer_flag) --json "$OUT/decode.json" --plot "$OUT/decode.svg"
}

part_ncu() {
  # One eager step at 4K by kernel (ncu): batch 1 and 64 by default (NCU_BATCH=1,64), bf16
  # weights by default (NCU_WEIGHTS).
  local ncu b steps
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n1 || true)
  [ -n "$ncu" ] || { echo "perf-run: ncu not found" >&2; return 1; }
  for b in ${NCU_BATCH//,/ }; do
    for steps in 1 2; do
      "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv --print-units base --log-file "$OUT/ncu-b$b-s$steps.csv" \
        "$BIN" bench decode --device "$DEV" "${DIMS[@]}" --weights "$NCU_WEIGHTS" --batch "$b" \
        --context 4096 --graph eager --warmup 0 --steps "$steps" "${BENCH_ARGS[@]}" >/dev/null
    done
    python3 scripts/ncu_step.py "$OUT/ncu-b$b-s1.csv" "$OUT/ncu-b$b-s2.csv" \
      --title "$NCU_WEIGHTS batch $b, 4K, eager"
  done
  # One prefill forward of NCU_PREFILL tokens (one repeat less the other).
  local reps
  for reps in 1 2; do
    "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
      --csv --print-units base --log-file "$OUT/ncu-p$NCU_PREFILL-r$reps.csv" \
      "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" "${NCU_PREFILL_ARGS[@]}" \
      --tokens "$NCU_PREFILL" --warmup 0 --repeats "$reps" >/dev/null
  done
  python3 scripts/ncu_step.py "$OUT/ncu-p$NCU_PREFILL-r1.csv" "$OUT/ncu-p$NCU_PREFILL-r2.csv" \
    --title "prefill ${NCU_PREFILL_ARGS[*]}, $NCU_PREFILL tokens" --top 25
}

part_gap() {
  # The decode loop's own host time between steps at batch 64 (issue 19: below 100 us):
  # the embedded model, 64 requests of 256 tokens at once through router + prefill +
  # decode (graphs), the gap histograms from decode's side port.
  local P D R
  P=$(start prefill "$BIN" prefill --device "$DEV" --listen 127.0.0.1:0)
  D=$(start decode "$BIN" decode --device "$DEV" --listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:9103)
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0)
  "$BIN" wait-ready --address "$R" --timeout-s 300
  "$BIN" bench serve --url "http://$R" --no-reference --concurrency 64 --sessions 64 \
    --turns 1 --prompt-len 5:44 --output-len 256 --shared-prefix-len 300 --ignore-eos
  python3 scripts/step_gaps.py 9103 "64 requests x 256 tokens"
  stop_all
}

part_ttft() {
  local model="$work/v4"
  "$BIN" bench config "${DIMS[@]}" --out "$model/config.json"
  # The bench's KV layout (bf16 entries and index-K): the servers' default f32 entries
  # take the fp32 attention kernel, not the tensor-core one the bench prefill times.
  local common=(--model "$model" --load-format dummy --device "$DEV" --kv-pages 512
    --kv-dtype bf16 --index-k-dtype bf16)
  local P D R
  # Debug lines of the engine and the prefill server: each forward's and export's time.
  P=$(start prefill env RUST_LOG=info,pdserve_engine=debug,pdserve_prefill_server=debug \
    "$BIN" prefill "${common[@]}" --chunked-prefill-size "$TTFT_TOKENS" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:9101)
  D=$(start decode env RUST_LOG=info,pdserve_kv_transfer=debug,pdserve_decode_server=debug \
    "$BIN" decode "${common[@]}" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:9102)
  R=$(start router "$BIN" router --model "$model" --prefill "$P" --decode "$D" \
    --listen 127.0.0.1:0)
  "$BIN" wait-ready --address "$R" --timeout-s 300
  # One request first, not counted (the servers' first forward sets up cuBLAS and the
  # memory pool), then one at a time: the time to first token against the prefill's own
  # compute, and each prefill's own line from the server's log. Two tokens each: the
  # first streams ahead of the KV, the second needs the whole transfer (a request ending
  # at its first token would drop it).
  "$BIN" bench serve --url "http://$R" --model "$model" --no-reference --concurrency 1 \
    --sessions 1 --turns 1 --prompt-len "$TTFT_TOKENS" --output-len 2 --ignore-eos --seed 99 >/dev/null
  "$BIN" bench serve --url "http://$R" --model "$model" --no-reference --concurrency 1 \
    --sessions "$TTFT_REQUESTS" --turns 1 --prompt-len "$TTFT_TOKENS" --output-len 2 --ignore-eos \
    --worker-metrics 127.0.0.1:9101,127.0.0.1:9102
  grep -hE "prefilled|prefill forward|model forward|cut states|sequence exported|first token sent ahead|answered by the engine|KV sent|cut points cached" "$work/prefill.out" "$work/prefill.err" \
    | tail -n $((9 * TTFT_REQUESTS)) | sed 's/\x1b\[[0-9;]*m//g; s/.*pdserve_[a-z_]*::[a-z_:]*: //' || true
  # The decode side of each pull: connected, header in, last byte in (from the pull's
  # start); then the pages' import into decode's pool as the request joins the batch.
  grep -hE "KV pulled|joined the batch" "$work/decode.out" "$work/decode.err" \
    | tail -n $((2 * TTFT_REQUESTS)) | sed 's/\x1b\[[0-9;]*m//g; s/.*pdserve_[a-z_]*::[a-z_:]*: //' || true
  # The router's own time to first token (request in to first token out), all requests.
  curl -s "http://$R/metrics" | grep -E "^pdserve_router_time_to_first_token_seconds_(sum|count)" || true
  stop_all
  # TTFT_BENCH=0: the cluster's part only (no bench prefill rows after it).
  [ "${TTFT_BENCH:-1}" = 1 ] || return 0
  # The prefill's compute alone on the same model and device, for the same prompt length.
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens "$TTFT_TOKENS" --weights bf16 \
    --repeats 3 --warmup 1 --json "$OUT/ttft-prefill.json"
  # The same with the prefix cache's cuts (its page boundaries) and their states read back.
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens "$TTFT_TOKENS" --weights bf16 \
    --cut-every 256 --repeats 3 --warmup 1 --json "$OUT/ttft-prefill-cuts.json"
}

for part in "$@"; do
  case $part in
    peer|prefill|prefill-deepseek|decode|ttft|ncu|gap) ;;
    *) echo "perf-run: unknown part '$part' (peer, prefill, prefill-deepseek, decode, ttft, ncu, gap)" >&2; exit 2;;
  esac
done
for part in "$@"; do
  echo "== perf-run: $part (log: $OUT/$part.log)"
  start_s=$SECONDS
  "part_${part//-/_}" 2>&1 | tee "$OUT/$part.log"
  echo "== perf-run: $part done in $((SECONDS - start_s)) s"
done
