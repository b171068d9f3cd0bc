#!/usr/bin/env bash
# The cluster on a GPU: a prefill and a decode server on cuda:$DEVICE (decode steps as
# CUDA graphs), a router in front; a greedy completion through the router must equal
# `pdserve generate` on the same GPU. Prints one PASS/FAIL line; exit status 1 on FAIL.
# Called by scripts/gpu-check.sh (which finds the CUDA libraries); BIN and DEVICE as there.
set -euo pipefail
BIN=${BIN:?set BIN to the pdserve binary}
DEVICE=${DEVICE:-0}
PROMPT="Once upon a time, in a small village by the sea, there lived"
TOKENS=24
work=$(mktemp -d)
source "$(dirname "$0")/cluster-lib.sh"
trap stop_all EXIT

P=$(start prefill "$BIN" prefill --device "cuda:$DEVICE" --listen 127.0.0.1:0)
D=$(start decode "$BIN" decode --device "cuda:$DEVICE" --cuda-graph capture --listen 127.0.0.1:0)
R=$(start router "$BIN" router --prefill "$P" --decode "$D" --listen 127.0.0.1:0)
got=$(python3 - "$R" "$PROMPT" "$TOKENS" <<'PY'
import json, sys, time, urllib.request
addr, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode()
for attempt in range(100):
    try:
        req = urllib.request.Request(f"http://{addr}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            print(json.load(r)["choices"][0]["text"], end="")
            break
    except Exception as e:  # workers may still be reporting healthy
        if attempt == 99:
            raise
        time.sleep(0.2)
PY
)
want=$("$BIN" --log-format text generate --device "cuda:$DEVICE" --max-new-tokens "$TOKENS" --prompt "$PROMPT" 2>/dev/null)
if [ "$got" == "$want" ]; then
  echo "cluster on cuda:$DEVICE (prefill + graph decode + router) == generate: PASS"
  echo "   text: $got"
else
  echo "cluster on cuda:$DEVICE (prefill + graph decode + router) == generate: FAIL"
  echo "   router:   $got"
  echo "   generate: $want"
  exit 1
fi
