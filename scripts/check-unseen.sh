#!/usr/bin/env bash
# Parity on checkpoints the tests never saw: builds fresh random DeepSeek-V4 models with
# transformers (new seed), feeds new random tokens through `pdserve logits` (prefill K, then
# decode steps) and compares every row with transformers' one-shot forward.
# Needs python3 with torch + transformers >= 5.17 (the H200 machine has them; or a venv).
# Usage: scripts/check-unseen.sh [SEED] [PDSERVE_BIN]
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-$RANDOM}
bin=${2:-target/release/pdserve}
[ -x "$bin" ] || cargo build --release -p pdserve
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 scripts/gen_fixtures.py --out "$work" --seed "$seed" >"$work/gen.log"
status=0
for dir in "$work"/*/; do
  name=$(basename "$dir")
  vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$dir/config.json")
  read -r tokens prefill < <(python3 -c "
import random, sys
r = random.Random(int(sys.argv[1]) * 7919 + len(sys.argv[3]))
n = r.randint(40, 260); v = int(sys.argv[2])
toks = [r.randrange(2, v) for _ in range(n)]
print(','.join(map(str, toks)), r.randint(1, n - 1))" "$seed" "$vocab" "$name")
  "$bin" logits --model "$dir" --tokens "$tokens" --prefill-len "$prefill" --out "$work/$name.json" 2>/dev/null
  echo "== $name (seed $seed, $(tr ',' '\n' <<<"$tokens" | wc -l) tokens, prefill $prefill)"
  python3 scripts/gen_fixtures.py --check-logits "$dir" --logits-json "$work/$name.json" --tokens "$tokens" \
    >"$work/$name.check" 2>&1 || status=1
  grep -E "^(PASS|FAIL|WARNING)|margin" "$work/$name.check" || tail -5 "$work/$name.check"
done
exit $status
