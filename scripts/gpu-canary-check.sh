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
pids=()
fail=0
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }
trap cleanup EXIT

start() {
  local name=$1; shift
  "$@" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  for _ in $(seq 1200); do
    local addr
    addr=$(sed -n 's/.*listening on //p' "$work/$name.out" | head -n1)
    if [ -n "$addr" ]; then echo "$addr"; return; fi
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then
      echo "gpu-canary-check: $name exited:" >&2; tail -5 "$work/$name.err" >&2; return 1
    fi
    sleep 0.1
  done
  echo "gpu-canary-check: $name did not start in 120 s" >&2; return 1
}

# load ROUTER SESSIONS TURNS STREAMS: prints "ok=N errors=M" (greedy, 8 new tokens a turn).
load() {
  python3 - "$@" <<'PY'
import json, sys, threading, time, urllib.request, random
addr, sessions, turns, stream = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
rng = random.Random(7)
system = [rng.randrange(3, 500) for _ in range(300)]
ok, errors, lock = [0], [], threading.Lock()
def post(body):
    req = urllib.request.Request(f"http://{addr}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        if not stream:
            return json.load(r)["choices"][0]["token_ids"]
        ids = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("event: error"):
                raise RuntimeError("stream error event")
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if "error" in d:
                    raise RuntimeError(d["error"])
                ids += d["choices"][0].get("token_ids", [])
        return ids
def session(i):
    r = random.Random(i)
    hist = list(system)
    for t in range(turns):
        hist += [r.randrange(3, 500) for _ in range(5 + i % 40)]
        try:
            ids = post({"prompt": hist, "max_tokens": 8 if not stream else 40, "temperature": 0, "ignore_eos": True, "stream": stream})
            with lock: ok[0] += 1
            hist += ids
        except Exception as e:
            with lock: errors.append(str(e)[:200])
            return
for attempt in range(100):
    try:
        post({"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}); break
    except Exception:
        time.sleep(0.2)
th = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
[t.start() for t in th]; [t.join() for t in th]
print(f"ok={ok[0]} errors={len(errors)}")
for e in errors[:3]: print("   error:", e)
PY
}

row() {  # row NAME INDEX_K GRAPH
  local name=$1 ik=$2 graph=$3 verify=()
  [ "$graph" = capture ] && verify=(--verify-graphs)
  local P D R out v m
  P=$(start prefill "$BIN" prefill --device "$DEV" --index-k-dtype "$ik" --kv-audit --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --index-k-dtype "$ik" --cuda-graph "$graph" --kv-audit "${verify[@]}" --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 48 3 0)
  v=$(grep -c "KV canary" "$work/prefill.err" "$work/decode.err" | awk -F: '{s+=$2} END {print s}')
  m=$(grep -c "verify-graphs: graph replay and eager run" "$work/decode.err")
  cleanup
  if [[ "$out" == *"errors=0"* ]] && [ "$v" = 0 ] && [ "$m" = 0 ]; then
    echo "canary under load, $name: PASS ($(head -1 <<<"$out"), violations=$v, graph mismatches=$m)"
  else
    echo "canary under load, $name: FAIL ($out, violations=$v, graph mismatches=$m)"; fail=1
  fi
}

scribble() {  # scribble KIND
  local kind=$1 P D R out
  P=$(start prefill "$BIN" prefill --device "$DEV" --index-k-dtype bf16 --listen 127.0.0.1:0) || return 1
  D=$(start decode "$BIN" decode --device "$DEV" --index-k-dtype bf16 --cuda-graph "$GRAPH" --kv-audit --debug-kv-scribble "$kind@4" --listen 127.0.0.1:0) || return 1
  R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0) || return 1
  out=$(load "$R" 6 1 1)
  cleanup
  if [[ "$out" == *"errors=1"* ]]; then
    echo "planted $kind scribble ($GRAPH decode) fails exactly its request: PASS ($(head -1 <<<"$out"))"
  else
    echo "planted $kind scribble ($GRAPH decode) fails exactly its request: FAIL ($out)"; fail=1
  fi
}

[ "$GRAPH" = capture ] && row "index-K bf16, graphs + --verify-graphs, 48 x 3 turns" bf16 capture
row "index-K bf16, eager, 48 x 3 turns" bf16 eager
[ "$GRAPH" = capture ] && row "index-K f32, graphs + --verify-graphs, 48 x 3 turns" f32 capture
for k in page index-k state; do scribble "$k"; done
exit $fail
