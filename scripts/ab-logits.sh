#!/usr/bin/env bash
# Bitwise A/B of two pdserve binaries' logits: a change that only moves work around (the
# order work is queued in, restructured host code around the same kernels) must give the
# same bytes. Run it before timing such a change; exit status 1 when any case differs.
#
#   scripts/ab-logits.sh OLD_BIN NEW_BIN                # on cuda:0
#   DEVICE=cpu scripts/ab-logits.sh OLD_BIN NEW_BIN
#
# Cases: the embedded model, 700 tokens of which 600 prefilled, at --kv-dtype bf16 and
# fp8; a random model (--load-format dummy) in DeepSeek's released formats with FP8 and
# with FP4 experts, dims that take the block-scaled FP8 GEMM (inputs in multiples of 128),
# under --numerics deepseek, 300 tokens of which 250 prefilled; the same at the V4 attention
# shape (head_dim 512, 64 heads: k_attention_wgmma on Hopper) with fp8 KV.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { sed -n '2,13p' "$0"; exit 2; }
OLD=$1
NEW=$2
DEVICE=${DEVICE:-cuda:0}
for bin in "$OLD" "$NEW"; do
  [ -x "$bin" ] || { echo "ab-logits: $bin is not an executable" >&2; exit 2; }
done
if [ "$DEVICE" != cpu ]; then
  # shellcheck source=scripts/cuda-libs.sh
  source scripts/cuda-libs.sh
  cuda_libs ab-logits
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PDSERVE_KERNEL_CACHE=${PDSERVE_KERNEL_CACHE:-$work/kernels}

# The quantized fixture's config at dims the FP8 GEMM takes, with FP8 and FP4 experts.
python3 - "$work" <<'PY'
import json, os, sys
base = json.load(open("tests/fixtures/quantized/config.json"))
base.update(hidden_size=256, head_dim=128, qk_rope_head_dim=32, num_attention_heads=4,
            q_lora_rank=256, o_lora_rank=128, index_head_dim=64, moe_intermediate_size=128,
            n_routed_experts=8, num_experts_per_tok=2)
configs = {f"deepseek-{e}": dict(base, expert_dtype=e) for e in ("fp8", "fp4")}
# The V4 attention shape (64 heads of 512 channels, 64 rope; the wgmma kernel on Hopper),
# a 128-key window and 64 indexer picks, so prefill rows span several key tiles.
v4 = dict(base, expert_dtype="fp8", head_dim=512, qk_rope_head_dim=64, num_attention_heads=64,
          partial_rotary_factor=0.125, sliding_window=128, index_topk=64)
v4["rope_parameters"] = {part: dict(rope, partial_rotary_factor=0.125)
                         for part, rope in base["rope_parameters"].items()}
configs["v4-attention"] = v4
for name, config in configs.items():
    folder = os.path.join(sys.argv[1], name)
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
PY
ids() { python3 -c "import sys; n, v, a = map(int, sys.argv[1:]); print(','.join(str((i * a + 11) % v) for i in range(n)))" "$@"; }
embedded_tokens=$(ids 700 512 37)
deepseek_vocab=$(python3 -c "import json; print(json.load(open('tests/fixtures/quantized/config.json'))['vocab_size'])")
deepseek_tokens=$(ids 300 "$deepseek_vocab" 29)

# case NAME ARGS...: both binaries' logits, compared byte for byte.
failed=0
case_ab() {
  local name=$1 side bin
  shift
  for side in old new; do
    bin=$OLD
    [ "$side" = new ] && bin=$NEW
    "$bin" --log-format text logits --device "$DEVICE" "$@" --out "$work/$name-$side.json" \
      >"$work/$name-$side.log" 2>&1 || { echo "FAIL $name: $side binary failed:"; tail -n 5 "$work/$name-$side.log"; failed=1; return; }
  done
  if cmp -s "$work/$name-old.json" "$work/$name-new.json"; then
    echo "PASS $name: logits bitwise equal"
  else
    echo "FAIL $name: logits differ"
    failed=1
  fi
}
for kv in bf16 fp8; do
  case_ab "embedded-kv-$kv" --kv-dtype "$kv" --tokens "$embedded_tokens" --prefill-len 600
done
for experts in fp8 fp4; do
  case_ab "deepseek-$experts-experts" --model "$work/deepseek-$experts" --load-format dummy \
    --numerics deepseek --kv-dtype fp8 --tokens "$deepseek_tokens" --prefill-len 250
done
case_ab "v4-attention-kv-fp8" --model "$work/v4-attention" --load-format dummy \
  --numerics deepseek --kv-dtype fp8 --tokens "$deepseek_tokens" --prefill-len 250
exit "$failed"
