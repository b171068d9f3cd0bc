#!/usr/bin/env python3
"""A committed fixture through `pdserve logits` on any device, against its expected logits
(transformers' one-shot forward, tests/fixtures/NAME/expected.safetensors).

    check_fixture.py --fixture tests/fixtures/quantized --device cuda:0 --tol 2e-2 [--bin B]

For each prefill length of the fixture's meta.json (prefill K tokens, then one-token decode
steps), every row must be within --tol relative L2 error, and its greedy token (argmax)
must equal the reference's, except on a tie: a row whose two best reference logits differ by
less than twice that row's largest |pdserve - reference| (a flip there is rounding, not a
bug; counted and printed). Prints one line per prefill length and PASS/FAIL; exit code 1
on FAIL. Python standard library only, so it runs wherever pdserve does (--device cpu with
--tol 1e-4 is the smoke test; scripts/gpu-check.sh runs it on the GPU).
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def read_expected(path):
    """tokens (list of int) and logits (list of rows) from an expected.safetensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()

    def tensor(name, fmt, size):
        info = header[name]
        lo, hi = info["data_offsets"]
        values = struct.unpack(f"<{(hi - lo) // size}{fmt}", data[lo:hi])
        return values, info["shape"]

    tokens, _ = tensor("tokens", "q", 8)
    flat, (rows, vocab) = tensor("logits", "f", 4)
    return list(tokens), [list(flat[r * vocab : (r + 1) * vocab]) for r in range(rows)]


def argmax(row):
    return max(range(len(row)), key=row.__getitem__)


def compare(got, want, tol):
    """(max rel err, rows over tol, greedy mismatches outside ties, ties)"""
    worst, over, flips, ties = 0.0, 0, 0, 0
    for g, w in zip(got, want):
        diff = [a - b for a, b in zip(g, w)]
        err = math.sqrt(sum(d * d for d in diff)) / max(math.sqrt(sum(b * b for b in w)), 1e-30)
        worst = max(worst, err if math.isfinite(err) else math.inf)
        over += not err <= tol
        if argmax(g) != argmax(w):
            top = sorted(w, reverse=True)
            if top[0] - top[1] < 2 * max(abs(d) for d in diff):
                ties += 1
            else:
                flips += 1
    return worst, over, flips, ties


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", required=True, help="fixture folder (checkpoint + expected.safetensors + meta.json)")
    ap.add_argument("--device", default="cpu", help="pdserve --device (cpu, cuda:N)")
    ap.add_argument("--tol", type=float, required=True, help="largest relative L2 error of a row")
    ap.add_argument("--bin", default=os.environ.get("PDSERVE_BIN", "target/release/pdserve"))
    ap.add_argument("pdserve_args", nargs="*", help="more `pdserve logits` flags (after --)")
    a = ap.parse_args()

    tokens, want = read_expected(os.path.join(a.fixture, "expected.safetensors"))
    with open(os.path.join(a.fixture, "meta.json")) as f:
        prefill_lens = json.load(f)["prefill_lens"]
    name = os.path.basename(os.path.normpath(a.fixture))
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for k in prefill_lens:
            out = os.path.join(tmp, f"{k}.json")
            cmd = [a.bin, "logits", "--model", a.fixture, "--device", a.device, "--tokens",
                   ",".join(map(str, tokens)), "--prefill-len", str(k), "--out", out, *a.pdserve_args]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"FAIL {name} {a.device} prefill {k}: pdserve exited {run.returncode}\n{run.stderr}")
                ok = False
                continue
            with open(out) as f:
                got = json.load(f)["logits"]
            if len(got) != len(want):
                print(f"FAIL {name} {a.device} prefill {k}: {len(got)} rows, expected {len(want)}")
                ok = False
                continue
            worst, over, flips, ties = compare(got, want, a.tol)
            row_ok = over == 0 and flips == 0
            ok &= row_ok
            print(f"{'PASS' if row_ok else 'FAIL'} {name} {a.device} prefill {k} + decode: max rel err "
                  f"{worst:.3e} (tol {a.tol:g}, {over} rows over), greedy: {flips} differ, {ties} ties")
    print(f"{'PASS' if ok else 'FAIL'}: {name} on {a.device}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
