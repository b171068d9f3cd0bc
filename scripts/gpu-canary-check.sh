#!/usr/bin/env bash
# The KV canary and the graph self-check in the servers on a GPU, under load: a prefill
# and a decode server on cuda:$DEVICE with --kv-audit (decode also --verify-graphs when
# capturing), a router in front, 48 concurrent 3-turn greedy sessions sharing a system
# prefix. Each row: 0 request errors, 0 canary violations, 0 graph mismatches. Then a
# planted scribble (page, index-K entry, state slot) into one running request's KV must
# fail exactly that request. Prints PASS/FAIL lines; exit status 1 on any FAIL.
# Called by scripts/gpu-check.sh (which finds the CUDA libraries); BIN and DEVICE as there.
set -uo pipefail
BIN=${BIN:?set BIN to the pdserve binary}
DEVICE=${DEVICE:-0}
# DEVICE=cpu runs the eager rows on the CPU (a smoke test of this script).
if [ "$DEVICE" = cpu ]; then DEV=cpu; GRAPH=eager; else DEV="cuda:$DEVICE"; GRAPH=capture; fi
work=$(mktemp -d)
source "$(dirname "$0")/cluster-lib.sh"
fail=0
trap stop_all EXIT

# load ROUTER SESSIONS TURNS OUTPUT [BENCH FLAGS...]: `pdserve bench serve` on the router
# (streamed greedy requests on a 300-token shared prefix, 5-44 new tokens a turn) once it
# is ready; prints "completed=N failed=M", with the reference's mismatches and top-2
# margins when the bench ran its reference (no --no-reference among the flags).
load() {
  local r=$1 sessions=$2 turns=$3 output=$4; shift 4
  "$BIN" wait-ready --address "$r" --timeout-s 120 >/dev/null 2>&1 || { echo "router not ready"; return; }
  "$BIN" bench serve --url "http://$r" --concurrency "$sessions" --sessions "$sessions" \
    --turns "$turns" --prompt-len 5:44 --output-len "$output" --shared-prefix-len 300 \
    --ignore-eos --json "$@" >"$work/serve.json" 2>"$work/serve.err"
  python3 - "$work/serve.json" <<'PY' || echo "no report ($(tail -2 "$work/serve.err"))"
import json, sys
r = json.load(open(sys.argv[1]))
q = r["requests"]
out = f"completed={q['completed']} failed={q['failed']}"
ref = r.get("reference")
if ref:
    ms = sorted(m["top2_margin"] for m in ref["mismatches"])
    pick = lambda p: ms[min(len(ms) - 1, int(p * len(ms)))]
    out += f" mismatches={ref['mismatched']}/{ref['checked']}"
    if ms:
        out += f" top-2 margin p50 {pick(.5):.3f} p90 {pick(.9):.3f} max {ms[-1]:.3f}"
print(out)
PY
}

row() {  # row NAME INDEX_K GRAPH
  local name=$1 ik=$2 graph=$3 verify=()
  [ "$graph" = capture ] && verify=(--verify-graphs)
  local P D R out v m
  P=$(start prefill "$BIN" prefill --device "$DEV" --index-k-dtype "$ik" --kv-audit --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --index-k-dtype "$ik" --cuda-graph "$graph" --kv-audit "${verify[@]}" --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 48 3 8 --no-reference)
  v=$(grep -c "KV canary" "$work/prefill.err" "$work/decode.err" | awk -F: '{s+=$2} END {print s}')
  m=$(grep -c "verify-graphs: graph replay and eager run" "$work/decode.err")
  stop_all
  if [[ "$out" == "completed=144 failed=0"* ]] && [ "$v" = 0 ] && [ "$m" = 0 ]; then
    echo "canary under load, $name: PASS ($out, violations=$v, graph mismatches=$m)"
  else
    echo "canary under load, $name: FAIL ($out, violations=$v, graph mismatches=$m)"; fail=1
  fi
}

scribble() {  # scribble KIND
  local kind=$1 P D R out
  P=$(start prefill "$BIN" prefill --device "$DEV" --index-k-dtype bf16 --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --index-k-dtype bf16 --cuda-graph "$GRAPH" --kv-audit --debug-kv-scribble "$kind@4" --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 6 1 40 --no-reference)
  stop_all
  if [[ "$out" == "completed=5 failed=1"* ]]; then
    echo "planted $kind scribble ($GRAPH decode) fails exactly its request: PASS ($out)"
  else
    echo "planted $kind scribble ($GRAPH decode) fails exactly its request: FAIL ($out)"; fail=1
  fi
}

# serve MODE_FLAG GATE: the load with the bench's own single-process reference (same
# mode) and the canary on. GATE=1: 0 failures and 0 mismatches required; GATE=noise: 0
# failures, and every mismatch's reference top-2 margin below NOISE_BOUND.
serve() {
  local mode=$1 gate=$2 P D R out
  P=$(start prefill "$BIN" prefill --device "$DEV" --index-k-dtype bf16 --kv-audit $mode --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --index-k-dtype bf16 --cuda-graph "$GRAPH" --kv-audit $mode --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 48 3 32 --device "$DEV" --index-k-dtype bf16 $mode)
  stop_all
  local label=${mode:-default}
  if [ "$gate" = noise ]; then
    # Default mode: mismatches are allowed only where the reference's top-2 margin is
    # below the greedy noise of batching that gpu-check measured (NOISE_BOUND).
    local max
    max=$(sed -n 's/.* max \([0-9.]*\)$/\1/p' <<<"$out")
    if [ -z "${NOISE_BOUND:-}" ]; then
      echo "cluster vs single-process reference, $label, 48 x 3 turns: info ($out; no NOISE_BOUND: run from gpu-check.sh)"
    elif [[ "$out" == "completed=144 failed=0"* ]] && python3 -c "import sys; sys.exit(not float('${max:-0}') < float('$NOISE_BOUND'))"; then
      echo "cluster vs single-process reference, $label, every mismatch below the noise bound $NOISE_BOUND: PASS ($out)"
    else
      echo "cluster vs single-process reference, $label, every mismatch below the noise bound $NOISE_BOUND: FAIL ($out)"; fail=1
    fi
  elif [[ "$out" == "completed=144 failed=0 mismatches=0/"* ]]; then
    echo "cluster == single-process reference, $label, 48 x 3 turns: PASS ($out)"
  else
    echo "cluster == single-process reference, $label, 48 x 3 turns: FAIL ($out)"; fail=1
  fi
}

# The decode loop's host time between steps (sampling, streaming, admission: the GPU idles
# meanwhile) under 64 concurrent sessions, from the decode server's
# pdserve_decode_step_gap_seconds on its side port (target: below 100 us). Info.
step_gap() {
  local port=$((20000 + RANDOM % 20000)) P D R out
  P=$(start prefill "$BIN" prefill --device "$DEV" --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --cuda-graph "$GRAPH" --metrics-listen "127.0.0.1:$port" --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 64 2 64 --no-reference)
  python3 scripts/step_gaps.py "$port" "64 sessions" ": info ($out)" \
    || echo "decode loop host gap: no metrics ($out)"
  stop_all
}

step_gap
[ "$GRAPH" = capture ] && row "index-K bf16, graphs + --verify-graphs, 48 x 3 turns" bf16 capture
row "index-K bf16, eager, 48 x 3 turns" bf16 eager
[ "$GRAPH" = capture ] && row "index-K f32, graphs + --verify-graphs, 48 x 3 turns" f32 capture
[ "$GRAPH" = capture ] && row "index-K fp8, graphs + --verify-graphs, 48 x 3 turns" fp8 capture
for k in page index-k state; do scribble "$k"; done
serve --deterministic 1
serve "" noise
exit $fail
