#!/usr/bin/env bash
# The measurement run behind docs/performance.md's tables, in parts that each fit one
# device call (10 minutes): on a CUDA machine, after scripts/gpu-check.sh passed on the
# same binary. Every part writes its JSON, figure and log into $OUT.
#
#   BIN=target/release/pdserve OUT=perf scripts/perf-run.sh peer prefill decode ttft
#
#   peer      transformers' eager reference on the same GPU (scripts/peer_bench.py):
#             $OUT/peer.json, which prefill and decode read when it exists (PEER=FILE
#             to reuse one)
#   prefill   1K, 8K, 32K tokens in one forward and 128K in chunks of 16K, bf16 and fp8,
#             against the GEMM rate measured in the same run
#   decode    batch 1..256, contexts 4K and 32K, bf16 and the stored formats, graphs and
#             eager, against the byte floor (WEIGHTS=bf16 for a shorter run)
#   ttft      an 8K prompt through router + prefill + decode (the bench's V4-Flash-dims
#             model, random weights: --load-format dummy) with the worker-side breakdown
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/pdserve}
OUT=${OUT:-perf}
DEV=${DEV:-cuda:0}
# The bench's model (DIMS="--tiny" TTFT_TOKENS=512 DEV=cpu: a smoke test of this script).
read -r -a DIMS <<<"${DIMS:---layers 4 --experts 64}"
TTFT_TOKENS=${TTFT_TOKENS:-8192}
WEIGHTS=${WEIGHTS:-bf16,fp8,fp8-fp4}
[ -x "$BIN" ] || { echo "perf-run: $BIN not found: cargo build --release first (or set BIN)" >&2; exit 2; }
[ $# -gt 0 ] || { sed -n '2,18p' "$0"; exit 2; }
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
  python3 scripts/peer_bench.py --config "$OUT/bench-config/config.json" --out "$PEER"
}

part_prefill() {
  # shellcheck disable=SC2046
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens 1024,8192,32768 --weights bf16,fp8 \
    --repeats 3 --warmup 1 $(peer_flag) --json "$OUT/prefill.json" --plot "$OUT/prefill.svg"
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens 131072 --chunk 16384 \
    --weights bf16,fp8 --repeats 1 --warmup 1 --json "$OUT/prefill-128k.json"
}

part_decode() {
  # shellcheck disable=SC2046
  "$BIN" bench decode --device "$DEV" "${DIMS[@]}" --weights "$WEIGHTS" \
    --context 4096,32768 --graph capture,eager --steps 20 --warmup 3 \
    $(peer_flag) --json "$OUT/decode.json" --plot "$OUT/decode.svg"
}

part_ttft() {
  local model="$work/v4"
  "$BIN" bench config "${DIMS[@]}" --out "$model/config.json"
  local common=(--model "$model" --load-format dummy --device "$DEV" --kv-pages 512)
  local P D R
  P=$(start prefill "$BIN" prefill "${common[@]}" --chunked-prefill-size "$TTFT_TOKENS" \
    --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:9101)
  D=$(start decode "$BIN" decode "${common[@]}" --listen 127.0.0.1:0 \
    --metrics-listen 127.0.0.1:9102)
  R=$(start router "$BIN" router --model "$model" --prefill "$P" --decode "$D" \
    --listen 127.0.0.1:0)
  "$BIN" wait-ready --address "$R" --timeout-s 300
  # One request at a time: the time to first token against the prefill's own compute.
  "$BIN" bench serve --url "http://$R" --model "$model" --no-reference --concurrency 1 \
    --sessions 8 --turns 1 --prompt-len "$TTFT_TOKENS" --output-len 1 --ignore-eos \
    --worker-metrics 127.0.0.1:9101,127.0.0.1:9102
  stop_all
  # The prefill's compute alone on the same model and device, for the same prompt length.
  "$BIN" bench prefill --device "$DEV" "${DIMS[@]}" --tokens "$TTFT_TOKENS" --weights bf16 \
    --repeats 3 --warmup 1 --json "$OUT/ttft-prefill.json"
}

for part in "$@"; do
  case $part in
    peer|prefill|decode|ttft) ;;
    *) echo "perf-run: unknown part '$part' (peer, prefill, decode, ttft)" >&2; exit 2;;
  esac
done
for part in "$@"; do
  echo "== perf-run: $part (log: $OUT/$part.log)"
  start_s=$SECONDS
  "part_$part" 2>&1 | tee "$OUT/$part.log"
  echo "== perf-run: $part done in $((SECONDS - start_s)) s"
done
