#!/usr/bin/env python3
"""One decode step's kernel time by kernel, from two ncu CSV logs of the same bench that
differ by one timed step (`--steps 1` and `--steps 2`): the per-kernel sums of the second
less the first, so model setup, KV fill and the bandwidth probe cancel out.

    ncu --csv --print-units base --metrics gpu__time_duration.sum --log-file one.csv \\
        pdserve bench decode ... --graph eager --warmup 0 --steps 1
    (the same with --steps 2 into two.csv)
    python3 scripts/ncu_step.py one.csv two.csv --title "bf16 batch 1"
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

UNIT_NS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
           "second": 1e9, "s": 1e9}


def kernel_family(name):
    """`void k_foo<1>(float*, ...)` -> `k_foo`; cuBLAS' nvjet/cutlass names by their stem."""
    name = re.sub(r"^void\s+", "", name.strip())
    name = name.split("(")[0].split("<")[0]
    if name.startswith("nvjet"):
        return "nvjet (cuBLAS)"
    return name


def per_kernel(path):
    """{kernel family: (launches, total ns)} from one ncu CSV log."""
    sums = defaultdict(lambda: [0, 0.0])
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = UNIT_NS.get(row.get("Metric Unit", "nsecond"), None)
        if unit is None:
            sys.exit(f"ncu_step: unknown unit {row.get('Metric Unit')!r} in {path}")
        value = float(row["Metric Value"].replace(",", ""))
        entry = sums[kernel_family(row["Kernel Name"])]
        entry[0] += 1
        entry[1] += value * unit
    return sums


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("one")
    ap.add_argument("two")
    ap.add_argument("--title", default="one step")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    one, two = per_kernel(a.one), per_kernel(a.two)
    if not two:
        sys.exit(f"ncu_step: no gpu__time_duration rows in {a.two}")
    step = {}
    for k, (n2, t2) in two.items():
        n1, t1 = one.get(k, (0, 0.0))
        if n2 - n1 > 0:
            step[k] = (n2 - n1, (t2 - t1) / 1e6)
    total = sum(ms for _, ms in step.values())
    launches = sum(n for n, _ in step.values())
    print(f"| {a.title}: {total:.3f} ms of kernels, {launches} launches | launches | ms | share |")
    print("|--|--:|--:|--:|")
    for k, (n, ms) in sorted(step.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"| `{k}` | {n} | {ms:.3f} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    main()
