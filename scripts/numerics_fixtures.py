#!/usr/bin/env python3
"""Reference values for pdserve's `deepseek` numerics, from an independent re-implementation
of DeepSeek-V4's quantization functions (inference/kernel.py and model.py of the model repo)
in numpy + ml_dtypes (their float8_e4m3fn / float4_e2m1fn / bfloat16 casts round to nearest
even, as the CUDA conversions the reference's kernels use).

Writes tests/fixtures/numerics/quant_reference.json (small: a few thousand values), read by
engine/tests/numerics_reference.rs, which checks pdserve's Rust functions bit for bit.

    python -m venv /tmp/venv && /tmp/venv/bin/pip install numpy ml_dtypes
    /tmp/venv/bin/python scripts/numerics_fixtures.py --out tests/fixtures/numerics

What is re-implemented (from the reference's text, not its code):
- act_quant(x, block, scale_fmt="ue8m0"): per block amax = max(max|x|, 1e-4);
  scale = 2^ceil(log2(amax * f32(1/448))) with the product in float32; codes =
  e4m3(clamp(x / scale, -448, 448)); value = code * scale.
- fp4_act_quant(x, 32): the same with amax floor 6 * 2^-126, max 6, e2m1 codes.
- rotate_activation: x @ H * n^-0.5, H the Sylvester Hadamard matrix (float64 here, then
  rounded to float32).
- FlashMLA's V4 ("MODEL1") compressed-KV entry: e4m3 codes of act_quant(kv[:448], 64), then
  the 64 rope values as bf16, in a 576-byte row; the 7 ue8m0 scale bytes (exponent + 127)
  plus one pad byte in a separate 8-byte block.
"""

import argparse
import json
import os

import ml_dtypes
import numpy as np

F32 = np.float32


def pow2_ceil_scale(amax, max_value):
    """2^ceil(log2(amax * f32(1/max))), the product rounded to float32 first."""
    x = F32(amax) * F32(1.0 / max_value)
    m, e = np.frexp(np.float64(x))  # x = m * 2^e, m in [0.5, 1)
    exp = int(e) - 1 if m == 0.5 else int(e)
    return F32(2.0**exp)


def quant_blocks(x, block, max_value, floor, fmt):
    """Codes (as the target dtype) and scales of every block of x (float32)."""
    x = np.asarray(x, dtype=F32)
    out, scales, codes = np.empty_like(x), [], []
    for start in range(0, len(x), block):
        v = x[start : start + block]
        amax = max(F32(np.abs(v).max()), F32(floor))
        s = pow2_ceil_scale(amax, max_value)
        q = np.clip(v / s, -max_value, max_value).astype(F32).astype(fmt)
        out[start : start + block] = q.astype(F32) * s
        scales.append(s)
        codes.append(q)
    return out, scales, codes


def act_quant(x, block):
    return quant_blocks(x, block, 448.0, 1e-4, ml_dtypes.float8_e4m3fn)


def fp4_act_quant(x, block=32):
    return quant_blocks(x, block, 6.0, 6.0 * 2.0**-126, ml_dtypes.float4_e2m1fn)


def hadamard(x):
    n = len(x)
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (np.asarray(x, dtype=np.float64) @ h * n**-0.5).astype(F32)


def floats(a):
    return [float(v) for v in np.asarray(a, dtype=F32)]


def edge_vector(rng, n):
    """Random values plus the edges act_quant meets: ties, powers of two, tiny values."""
    v = rng.standard_normal(n).astype(F32) * F32(3.0)
    v[0] = F32(448.0 * 4)  # amax exactly 448 * 2^2: scale 4, code 448
    v[1] = F32(1.0625 * 4)  # a tie between e4m3 1.0 and 1.125 (times the scale): even code
    v[2] = F32(-1.1875 * 4)  # a tie between 1.125 and 1.25: even code
    v[3] = F32(0.0)
    v[4] = F32(-0.0)
    v[5] = F32(2.0**-9 * 4 * 1.5)  # a tie in the subnormal range
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rng = np.random.default_rng(20261201)

    cases = []
    # act_quant, block 128: random + edges; amax a hair above a power of two times 448;
    # an all-zero block and a block under the 1e-4 amax floor.
    whole = edge_vector(rng, 128)
    above = rng.standard_normal(128).astype(F32)
    above[7] = np.nextafter(F32(448.0), F32(1e9))  # amax/448 just over 1: scale 2
    zeros = np.zeros(128, dtype=F32)
    tiny = (rng.standard_normal(128) * 1e-6).astype(F32)
    big = (rng.standard_normal(128) * 1e30).astype(F32)
    for name, x in [("edges", whole), ("just_over_pow2", above), ("zeros", zeros),
                    ("under_amax_floor", tiny), ("huge", big)]:
        y, s, c = act_quant(x, 128)
        cases.append({"fn": "act_quant", "name": name, "block": 128, "x": floats(x),
                      "y": floats(y), "scales": floats(s)})
    # Block 64 over a 448-value row (the compressed KV's non-rope part).
    kv = (rng.standard_normal(448) * np.repeat(rng.uniform(0.01, 20, 7), 64)).astype(F32)
    y, s, c = act_quant(kv, 64)
    cases.append({"fn": "act_quant", "name": "kv_nope_448", "block": 64, "x": floats(kv),
                  "y": floats(y), "scales": floats(s)})

    # fp4_act_quant, block 32: random, the e2m1 ties, zeros, the amax floor.
    f = rng.standard_normal(96).astype(F32)
    f[:8] = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=F32)  # scale 1 ties
    f[32:64] = 0.0
    f[64] = F32(1e-38)
    y, s, c = fp4_act_quant(f)
    cases.append({"fn": "fp4_act_quant", "name": "edges", "block": 32, "x": floats(f),
                  "y": floats(y), "scales": floats(s)})

    # The indexer: two 64-dim heads (one with outlier channels), rotated then FP4.
    heads = rng.standard_normal(128).astype(F32)
    heads[70] = F32(40.0)
    heads[100] = F32(-25.0)
    rot = np.concatenate([hadamard(heads[:64]), hadamard(heads[64:])])
    y = np.concatenate([fp4_act_quant(rot[:64])[0], fp4_act_quant(rot[64:])[0]])
    cases.append({"fn": "hadamard_fp4", "name": "two_heads", "head_dim": 64,
                  "x": floats(heads), "rotated": floats(rot), "y": floats(y)})

    # One V4 compressed-KV entry in FlashMLA's MODEL1 layout.
    entry = np.concatenate([kv, (rng.standard_normal(64) * 2).astype(F32)])
    _, s, c = act_quant(entry[:448], 64)
    row = np.concatenate([np.concatenate(c).view(np.uint8),
                          entry[448:].astype(ml_dtypes.bfloat16).view(np.uint8)])
    scale_bytes = [int(np.frexp(np.float64(v))[1]) - 1 + 127 for v in s] + [0]
    cases.append({"fn": "fp8_kv_entry", "name": "v4_512_64", "head_dim": 512, "rope_dim": 64,
                  "x": floats(entry), "row_hex": row.tobytes().hex(),
                  "scales_hex": bytes(scale_bytes).hex()})

    os.makedirs(args.out, exist_ok=True)
    meta = {"generator": "scripts/numerics_fixtures.py", "numpy": np.__version__,
            "ml_dtypes": ml_dtypes.__version__, "cases": cases}
    with open(os.path.join(args.out, "quant_reference.json"), "w") as fh:
        json.dump(meta, fh, separators=(",", ":"))
        fh.write("\n")


if __name__ == "__main__":
    main()
