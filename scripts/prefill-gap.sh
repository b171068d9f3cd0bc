#!/bin/bash
# The prefill server's own model forward (its "model forward" debug line) for 8K prompts
# sent one at a time and four at a time (queued: forwards back to back), with tokio's
# default workers and with 2: what separates the server's forward from `bench prefill`'s.
#   BIN=target/release/pdserve scripts/prefill-gap.sh      (one GPU; ~30 s)
set -u
B=${BIN:-target/release/pdserve}
[ -x "$B" ] || { echo "prefill-gap: $B not found: cargo build --release first (or set BIN)" >&2; exit 2; }
work=$(mktemp -d)
source scripts/cluster-lib.sh
source scripts/cuda-libs.sh; cuda_libs gap
export PDSERVE_KERNEL_CACHE=${PDSERVE_KERNEL_CACHE:-$work/kernels}
trap 'stop_all; rm -rf "$work"' EXIT
M=$work/v4; $B bench config --layers 4 --experts 64 --out $M/config.json >/dev/null
common=(--model $M --load-format dummy --device cuda:0 --kv-pages 1024 --kv-dtype bf16 --index-k-dtype bf16)
for mode in default tokio2; do
  if [ $mode = tokio2 ]; then export TOKIO_WORKER_THREADS=2; fi
  P=$(start prefill env RUST_LOG=info,pdserve_engine=debug $B prefill "${common[@]}" --chunked-prefill-size 8192 --listen 127.0.0.1:0)
  D=$(start decode $B decode "${common[@]}" --listen 127.0.0.1:0)
  R=$(start router $B router --model $M --prefill "$P" --decode "$D" --listen 127.0.0.1:0)
  $B wait-ready --address "$R" --timeout-s 300 >/dev/null
  for c in 1 4; do
    $B bench serve --url "http://$R" --model $M --no-reference --concurrency $c --sessions 8 --turns 1 --prompt-len 8192 --output-len 1 --ignore-eos --seed $((100+c)) > $work/serve-$c.txt 2>&1
    echo "== $mode concurrency $c: model forward ms:"; grep -h "model forward" $work/prefill.out $work/prefill.err | sed 's/\x1b\[[0-9;]*m//g; s/.*ms=//' | tail -8 | cut -c1-5 | tr '\n' ' '; echo
    grep -E "^\|  *TTFT" $work/serve-$c.txt
  done
  stop_all
  sleep 1
done
